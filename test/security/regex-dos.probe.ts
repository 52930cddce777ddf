/**
 * Run by regex-dos.test.ts in a child process (a stalled event loop cannot be timed out from
 * inside itself): fires catastrophic patterns and ordinary calls at one FileTools at once and
 * prints each answer as a JSON line, in the order they arrive.
 *
 *   node --import tsx test/security/regex-dos.probe.ts <workspace>
 */
import { Workspace } from '../../guest-agent/src/workspace/confine.ts';
import { FileTools } from '../../guest-agent/src/workspace/file-tools.ts';
import { compileGlob } from '../../guest-agent/src/workspace/glob-match.ts';

const dir = process.argv[2] as string;
const tools = new FileTools(new Workspace(dir), { searchTimeoutMs: 5_000 });
const STAR_GLOB = '*a*a*a*a*a*a*a*a*a*a*a*a*c';
const log = (e: Record<string, unknown>) => process.stdout.write(JSON.stringify(e) + '\n');
const settle = (name: string, p: Promise<unknown>) =>
  p.then(
    (result) => log({ name, result }),
    (err: { code?: string; message?: string }) => log({ name, code: err.code, message: err.message }),
  );

// Cannot run on the linear engine (case-insensitive): runs in a worker until its deadline.
const slow = settle('grep-i', tools.grep({ pattern: '^(a+)+$', ignoreCase: true }));
await settle('grep', tools.grep({ pattern: '^(a+)+$' }));
await settle('glob', tools.glob({ pattern: STAR_GLOB }));
await settle('list', tools.list({ ignore: [STAR_GLOB] }));
log({ name: 'compileGlob', result: [compileGlob(STAR_GLOB)('a'.repeat(41)), compileGlob(STAR_GLOB)('a'.repeat(40) + 'c')] });
for (let i = 0; i < 3; i++) await settle('read', tools.read({ path: 'short.txt', numbered: false }));
await slow;
// The worker stuck past its deadline was killed; the pool serves the next search.
await settle('grep-after', tools.grep({ pattern: 'hel+o' }));
process.exit(0);
