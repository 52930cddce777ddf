/**
 * What hutch's commands print for people: colour only on a terminal (and never with
 * NO_COLOR set, https://no-color.org), errors on stderr, and the exit status a shell
 * script can branch on: 2 for a command line the command cannot run with, 1 for a
 * failure while running.
 */
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { isUsageError } from '../../../guest-agent/src/cli-options.ts';

export interface Styles {
  bold(s: string): string;
  dim(s: string): string;
  red(s: string): string;
  yellow(s: string): string;
  green(s: string): string;
}

/** Styles for one stream: escape codes only when it is a terminal and NO_COLOR is unset or empty. */
export function stylesFor(stream: { isTTY?: boolean }, env: NodeJS.ProcessEnv = process.env): Styles {
  const on = stream.isTTY === true && !env['NO_COLOR'];
  const sgr = (open: string) => (s: string) => (on ? `\x1b[${open}m${s}\x1b[0m` : s);
  return { bold: sgr('1'), dim: sgr('2'), red: sgr('1;31'), yellow: sgr('1;33'), green: sgr('32') };
}

/** Exit status for an error: 2 for a usage error, 1 for anything else. */
export function exitStatusOf(err: unknown): 1 | 2 {
  return isUsageError(err) ? 2 : 1;
}

/** One error as people read it: `hutch: message` for a usage error, `hutch: code: message` for a failure. */
export function describeError(prog: string, err: unknown, styles: Styles = stylesFor(process.stderr)): string {
  const head = styles.red(`${prog}:`);
  if (isUsageError(err)) return `${head} ${(err as Error).message}\n`;
  if (err instanceof HutchError) return `${head} ${err.code}: ${err.message}\n`;
  return `${head} ${(err as Error)?.message ?? String(err)}\n`;
}

/** Runs a command's main: an error goes to stderr and sets the exit status (see exitStatusOf). */
export function runMain(prog: string, main: () => Promise<void>): void {
  main().catch((err: unknown) => {
    process.stderr.write(describeError(prog, err));
    if (process.env['HUTCH_DEBUG'] && err instanceof Error && err.stack) process.stderr.write(`${err.stack}\n`);
    process.exit(exitStatusOf(err));
  });
}
