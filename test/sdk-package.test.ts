/**
 * The SDK as a harness gets it: `npm pack` (which builds dist/ through `prepack`), the
 * tarball installed into an empty project, and a plain `.mjs` script run by plain Node (no
 * tsx, no TypeScript) against a real broker started from the package's own `hutch` bin
 * (unsafe-local backend: no VM needed, so this runs in the host tier). Its consumer types
 * are checked with tsc against the installed .d.ts files.
 */
import { spawn, spawnSync, execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';

const repo = resolve(import.meta.dirname, '..');
const work = mkdtempSync(join(tmpdir(), 'hutch-sdk-package-'));
const app = join(work, 'app');

interface PackedFile {
  path: string;
}

let packed: { filename: string; files: PackedFile[] };

beforeAll(() => {
  // --json: stdout is the report; prepack's build logs go to stderr.
  const out = execFileSync('npm', ['pack', '--json', '--pack-destination', work], { cwd: repo, encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'], maxBuffer: 64 * 1024 * 1024 });
  const report = JSON.parse(out) as Array<{ filename: string; files: PackedFile[] }>;
  packed = report[0] as { filename: string; files: PackedFile[] };
  mkdirSync(app);
  writeFileSync(join(app, 'package.json'), `${JSON.stringify({ name: 'harness', version: '1.0.0', private: true, type: 'module' }, null, 2)}\n`);
  execFileSync('npm', ['install', '--no-audit', '--no-fund', '--prefer-offline', '--loglevel=error', join(work, packed.filename)], { cwd: app, stdio: ['ignore', 'pipe', 'pipe'] });
}, 600_000);

afterAll(() => {
  rmSync(work, { recursive: true, force: true });
});

describe('the hutch npm package', () => {
  it('carries the compiled SDK, its types and the CLI, and no builder, agent or source', () => {
    const files = packed.files.map((f) => f.path).sort();
    for (const f of ['package.json', 'dist/index.js', 'dist/cli.js', 'dist/spawn-helper-main.js', 'dist/types/host-broker/src/sdk/index.d.ts']) expect(files).toContain(f);
    expect(files.filter((f) => f.includes('hutch-agent'))).toEqual([]);
    expect(files.filter((f) => f.endsWith('.ts') && !f.endsWith('.d.ts'))).toEqual([]);
    expect(files.filter((f) => /^(rootfs|kernel-configs|build|guest-agent|host-broker|test|bench|examples)\//.test(f))).toEqual([]);
    // The CLI bundle has the builders stubbed out: no debootstrap, no kernel compile.
    const cli = readFileSync(join(app, 'node_modules/hutch/dist/cli.js'), 'utf8');
    expect(cli).not.toMatch(/debootstrap --variant/);
    expect(cli).toContain('has no guest image builder');
  });

  it('installs without TypeScript tooling and resolves `hutch` to compiled JavaScript', () => {
    expect(existsSync(join(app, 'node_modules/tsx'))).toBe(false);
    expect(existsSync(join(app, 'node_modules/typescript'))).toBe(false);
    const resolved = execFileSync(process.execPath, ['--input-type=module', '-e', "console.log(import.meta.resolve('hutch'))"], { cwd: app, encoding: 'utf8' }).trim();
    expect(resolved).toMatch(/node_modules\/hutch\/dist\/index\.js$/);
  });

  it('a plain .mjs harness drives a real broker from the package bin: create, write, run, read, close', async () => {
    const broker = await startPackagedBroker();
    try {
      writeFileSync(
        join(app, 'harness.mjs'),
        `import { Hutch } from 'hutch';
const [url, token] = process.argv.slice(2);
const hutch = await Hutch.connect(url, { token, encoding: 'json' });
const sb = await hutch.create({ workspace: { files: { 'seed.txt': 'seed\\n' } } });
const info = (r) => ({ route: r.route, reason: r.reason, woke: r.woke, totalMs: r.timing.totalMs, addedMs: r.addedMs });
const write = await sb.files.write('hello.txt', 'hello from a plain .mjs\\n');
const run = await sb.run('cat hello.txt seed.txt && python3 -c "print(6 * 7)"');
const read = await sb.files.read('hello.txt');
const closed = await sb.close();
hutch.close();
const hello = { level: hutch.hello.policy?.level, idleMs: hutch.hello.policy?.idleMs, broker: hutch.hello.versions?.broker, limits: Object.keys(hutch.hello.limits ?? {}).length };
console.log(JSON.stringify({ hello, write: info(write), run: { ...info(run), exitCode: run.exitCode, stdout: run.stdout }, read: { ...info(read), content: read.content }, closed }));
`,
      );
      const out = execFileSync(process.execPath, ['harness.mjs', broker.url, broker.token], { cwd: app, encoding: 'utf8', timeout: 120_000 });
      const r = JSON.parse(out.trim().split('\n').at(-1) ?? '') as Record<string, Record<string, unknown>>;
      // The hello tells a harness the broker's version, policy and limits.
      const version = (JSON.parse(readFileSync(join(repo, 'package.json'), 'utf8')) as { version: string }).version;
      expect(r['hello']).toMatchObject({ level: '4', idleMs: 5000, broker: version });
      expect(r['hello']?.['limits']).toBeGreaterThan(0);
      expect(r['write']).toMatchObject({ route: 'inprocess' });
      expect(r['run']).toMatchObject({ exitCode: 0, stdout: 'hello from a plain .mjs\nseed\n42\n', route: 'vm' });
      expect(r['read']?.['content']).toContain('hello from a plain .mjs');
      expect(r['read']).toMatchObject({ route: 'inprocess' });
      // Every result says where it ran, why, and what it cost, file tools as well as run.
      for (const k of ['write', 'run', 'read']) {
        expect(typeof r[k]?.['reason'], k).toBe('string');
        expect(r[k]?.['totalMs'], k).toBeGreaterThanOrEqual(0);
        expect(typeof r[k]?.['addedMs'], k).toBe('number');
      }
    } finally {
      await broker.stop();
    }
  }, 180_000);

  it("the README's SDK example runs as written, from the package, against ./hutch serve (unsafe-local)", async () => {
    await runReadmeExample(['--backend', 'unsafe-local', '--i-know-unsafe-local']);
  }, 300_000);

  it('ships .d.ts types a TypeScript harness compiles against', () => {
    writeFileSync(
      join(app, 'typed.ts'),
      `import { Hutch, HutchError, type RunResult, type FileResult } from 'hutch';
export async function go(url: string): Promise<number> {
  const h = await Hutch.connect(url, { token: 't' });
  const sb = await h.create({ cpus: 1 });
  const r: RunResult = await sb.run('true');
  const f: FileResult<'fs.read'> = await sb.files.read('a');
  const n: number = f.timing.totalMs + r.addedMs;
  // @ts-expect-error: a read result has no exit code
  void f.exitCode;
  if (!(new HutchError('timeout', 'x') instanceof Error)) throw new Error('HutchError is an Error');
  return n + f.content.length;
}
`,
    );
    writeFileSync(join(app, 'tsconfig.json'), JSON.stringify({ compilerOptions: { module: 'NodeNext', moduleResolution: 'NodeNext', target: 'ES2022', strict: true, noEmit: true, skipLibCheck: true, types: [] }, files: ['typed.ts'] }));
    const tsc = join(repo, 'node_modules/typescript/bin/tsc');
    const r = spawnSyncText(process.execPath, [tsc, '-p', join(app, 'tsconfig.json')], app);
    expect(r.output, r.output).toBe('');
    expect(r.status).toBe(0);
  }, 120_000);
});

describe("the README's SDK example on the default backend", { tags: ['vm'] }, () => {
  it('runs as written against ./hutch serve: the test suite in a microVM', async () => {
    await runReadmeExample(['--standby', '0']);
  }, 900_000);
});

/** The README's SDK block, unchanged, run by plain Node from the installed package against `./hutch serve` in this clone. */
async function runReadmeExample(serveArgs: string[]): Promise<void> {
  const readme = readFileSync(join(repo, 'README.md'), 'utf8');
  const block = /```js\n(import \{ Hutch \} from 'hutch';\n[\s\S]*?)```/.exec(readme)?.[1];
  expect(block, "README.md's SDK example").toBeDefined();
  writeFileSync(join(app, 'readme-example.mjs'), block as string);
  const token = 'readme-example-token-0123456789';
  writeFileSync(join(work, 'token'), `${token}\n`, { mode: 0o600 });
  // ./hutch serve as the README runs it, on a free port; the example reads HUTCH_URL and HUTCH_TOKEN.
  const p = spawn('./hutch', ['serve', '--port', '0', '--token-file', join(work, 'token'), '--data-dir', join(work, `data-readme-${serveArgs.length}`), '--ready-json', '--log-level', 'warn', ...serveArgs], { cwd: repo, stdio: ['ignore', 'pipe', 'pipe'] });
  let stderr = '';
  p.stderr.on('data', (d: Buffer) => (stderr += d.toString()));
  try {
    const ready = await new Promise<{ url: string }>((res, rej) => {
      let out = '';
      p.stdout.on('data', (d: Buffer) => {
        out += d.toString();
        if (out.includes('\n')) res(JSON.parse(out.slice(0, out.indexOf('\n'))) as { url: string });
      });
      p.once('exit', (c) => rej(new Error(`./hutch serve exited ${c}: ${stderr.slice(-2000)}`)));
    });
    const r = spawnSyncText(process.execPath, ['readme-example.mjs'], app, { HUTCH_URL: ready.url, HUTCH_TOKEN: token });
    expect(r.status, r.output).toBe(0);
    const lines = r.stdout.trim().split('\n');
    expect(lines[0], r.output).toMatch(/^inprocess \d+(\.\d+)?$/);
    expect(lines[1], r.output).toMatch(/^0 vm .+ \d+(\.\d+)?$/);
    expect(r.output).toMatch(/Ran 1 test/);
  } finally {
    p.kill('SIGTERM');
    if (p.exitCode === null) await new Promise((r) => p.once('exit', r));
  }
}

/** `hutch serve` from the installed package, told to report readiness on fd 3. */
async function startPackagedBroker(): Promise<{ url: string; token: string; stop: () => Promise<void> }> {
  const token = 'sdk-package-test-token';
  const dataDir = join(work, 'data');
  const bin = join(app, 'node_modules/.bin/hutch');
  const p = spawn(bin, ['serve', '--port', '0', '--token', token, '--data-dir', dataDir, '--backend', 'unsafe-local', '--i-know-unsafe-local', '--ready-fd', '3', '--log-level', 'warn'], {
    stdio: ['ignore', 'pipe', 'pipe', 'pipe'],
  });
  let stderr = '';
  p.stderr?.on('data', (d: Buffer) => (stderr += d.toString()));
  const readyPipe = p.stdio[3] as NodeJS.ReadableStream;
  const ready = await new Promise<string>((res, rej) => {
    let text = '';
    readyPipe.on('data', (d: Buffer) => (text += d.toString()));
    // The broker closes the descriptor after the one line: EOF means "listening".
    readyPipe.on('end', () => res(text));
    p.once('exit', (code) => rej(new Error(`the packaged broker exited ${code} before it was ready: ${stderr}`)));
  });
  expect(ready.endsWith('\n')).toBe(true);
  expect(ready.trim().split('\n')).toHaveLength(1);
  const info = JSON.parse(ready) as { url: string; port: number; token?: string };
  expect(info.url).toBe(`ws://127.0.0.1:${info.port}`);
  expect(info.token).toBeUndefined(); // given on the command line: not repeated
  return {
    url: info.url,
    token,
    stop: async () => {
      p.kill('SIGTERM');
      if (p.exitCode === null) await new Promise((r) => p.once('exit', r));
    },
  };
}

function spawnSyncText(cmd: string, args: string[], cwd: string, env: NodeJS.ProcessEnv = {}): { status: number | null; stdout: string; output: string } {
  const r = spawnSync(cmd, args, { cwd, encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, ...env }, timeout: 600_000 });
  return { status: r.status, stdout: r.stdout, output: `${r.stdout}${r.stderr}`.trim() };
}

