/**
 * Tenant tokens on a command line (serve, gateway): `--token`, `--token-file` (so a token
 * never has to be on the command line, where `ps` shows it), HUTCH_TOKEN, and named
 * principals in `--tokens-file`. All of them are checked together before any work: too
 * short, spaced, or one token for two principals is a usage error naming the option.
 */
import { fileText, UsageError, type OptionSpec } from '../../../guest-agent/src/cli-options.ts';
import { DEFAULT_PRINCIPAL, MIN_TOKEN_CHARS, parseTokens, Principals } from '../api/principals.ts';

function token(text: string, option: string): string {
  if (text.length < MIN_TOKEN_CHARS || /\s/.test(text)) throw new UsageError(`${option}: a token must be at least ${MIN_TOKEN_CHARS} characters without spaces (openssl rand -hex 32 makes one)`, option);
  return text;
}

export const TOKEN_OPTIONS = {
  token: { arg: 'T', help: `the bearer token of the principal "default" (at least ${MIN_TOKEN_CHARS} characters;\nvisible in ps: prefer --token-file or HUTCH_TOKEN)`, parse: token },
  'token-file': { arg: 'F', help: 'read that token from file F (its first line)', parse: (t: string, o: string) => token(fileText(t, o).split(/\r?\n/)[0] ?? '', o) },
  'tokens-file': { arg: 'F', help: 'named principals: "name:token" lines, or a JSON object name -> token;\neach principal sees only its own sessions', parse: (t: string, o: string) => ({ file: t, tokens: parseTokens(fileText(t, o), o) }) },
} satisfies Record<string, OptionSpec>;

export interface TokenValues {
  token?: string | undefined;
  'token-file'?: string | undefined;
  'tokens-file'?: { file: string; tokens: Record<string, string> } | undefined;
}

/**
 * The principals these options name: `--token`, else `--token-file`, else HUTCH_TOKEN is
 * the principal "default", beside `--tokens-file`'s. Empty when none was given.
 */
export function tokensFrom(v: TokenValues, env: NodeJS.ProcessEnv = process.env): { tokens: Record<string, string>; single: string | undefined; source: string | undefined } {
  if (v.token !== undefined && v['token-file'] !== undefined) throw new UsageError('give --token or --token-file, not both', '--token-file');
  const fromEnv = env['HUTCH_TOKEN'] ? token(env['HUTCH_TOKEN'], 'HUTCH_TOKEN') : undefined;
  const single = v.token ?? v['token-file'] ?? fromEnv;
  const source = v.token !== undefined ? '--token' : v['token-file'] !== undefined ? '--token-file' : fromEnv !== undefined ? 'HUTCH_TOKEN' : undefined;
  const named = v['tokens-file']?.tokens ?? {};
  if (single !== undefined && Object.hasOwn(named, DEFAULT_PRINCIPAL)) throw new UsageError(`${source} and --tokens-file ${v['tokens-file']?.file} both name the principal "${DEFAULT_PRINCIPAL}"`, source);
  const tokens = { ...(single !== undefined ? { [DEFAULT_PRINCIPAL]: single } : {}), ...named };
  if (Object.keys(tokens).length > 0) {
    try {
      new Principals(tokens);
    } catch (err) {
      const which = [source, v['tokens-file'] ? `--tokens-file ${v['tokens-file'].file}` : undefined].filter(Boolean).join(' and ');
      throw new UsageError(`${which}: ${(err as Error).message}`, v['tokens-file'] ? '--tokens-file' : source);
    }
  }
  return { tokens, single, source };
}
