/**
 * What users of a Node CLI expect of `./hutch`, on a machine with no guest image cached (an
 * empty HUTCH_CACHE per run): `--version`; `--help` for every command and subcommand, about
 * that command only; a bad option refused with its name in the message and exit status 2,
 * before any set-up step (the package tools are shims that record being called) and before
 * anything is built; errors on stderr, coloured only on a terminal without NO_COLOR.
 *
 * "At once" is checked against starting Node with tsx at all, measured in the same run, in
 * CPU time (what the command and its children used, which other load on the machine
 * barely moves): at most 1.2 s more than that baseline (loading the broker before checking
 * the options cost 2 s more); and, when the machine is quiet enough for wall time to mean
 * something (the baseline under 0.7 s), within 2 s.
 */
import { spawn, spawnSync } from 'node:child_process';
import { chmodSync, existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';

const repo = resolve(import.meta.dirname, '..');
const work = mkdtempSync(join(tmpdir(), 'hutch-cli-'));
const shims = join(work, 'shims');
const called = join(work, 'called.log');
let baseline = { ms: 0, cpuMs: 0 };

afterAll(() => rmSync(work, { recursive: true, force: true }));

beforeAll(() => {
  // The set-up steps' tools: any of them running means a command did slow work first.
  mkdirSync(shims);
  for (const tool of ['apt-get', 'dpkg-query', 'npm', 'debootstrap', 'make', 'qemu-system-x86_64']) {
    writeFileSync(join(shims, tool), `#!/bin/sh\necho ${tool} "$@" >> ${called}\nexit 1\n`);
    chmodSync(join(shims, tool), 0o755);
  }
  writeFileSync(join(work, 'tiny.ts'), 'const n: number = 1;\nprocess.stdout.write(String(n));\n');
  // The baseline: the least a TypeScript command can cost here and now.
  const runs = [0, 1, 2].map(() => timed(process.execPath, ['--import', 'tsx', join(work, 'tiny.ts')]));
  baseline = { ms: Math.min(...runs.map((r) => r.ms)), cpuMs: Math.min(...runs.map((r) => r.cpuMs)) };
}, 60_000);

interface Run {
  code: number | null;
  stdout: string;
  stderr: string;
  ms: number;
  /** User and system CPU time of the command and everything it ran. */
  cpuMs: number;
  cache: string;
}

/** Runs a command under bash, whose `times` then tells the CPU time its children used (on stderr's last line). */
function timed(cmd: string, args: string[], env: NodeJS.ProcessEnv = {}): Run {
  const cache = mkdtempSync(join(work, 'cache-'));
  const t0 = performance.now();
  const r = spawnSync('bash', ['-c', '"$@"; s=$?; times >&2; exit $s', 'bash', cmd, ...args], { cwd: repo, encoding: 'utf8', env: { ...process.env, HUTCH_CACHE: cache, PATH: `${shims}:${process.env['PATH']}`, ...env }, timeout: 60_000 });
  const ms = performance.now() - t0;
  const lines = r.stderr.replace(/\n$/, '').split('\n');
  const children = (lines.at(-1) ?? '').split(' ').map((t) => /^(\d+)m([\d.]+)s$/.exec(t)).map((m) => (m ? (Number(m[1]) * 60 + Number(m[2])) * 1000 : NaN));
  const stderr = lines.slice(0, -2).join('\n') + (lines.length > 2 ? '\n' : '');
  return { code: r.status, stdout: r.stdout, stderr, ms, cpuMs: (children[0] ?? NaN) + (children[1] ?? NaN), cache };
}

const hutch = (args: string[], env: NodeJS.ProcessEnv = {}) => timed('./hutch', args, env);

function atOnce(r: Run): void {
  expect(existsSync(called) ? readFileSync(called, 'utf8') : '', 'a set-up tool ran').toBe('');
  expect(readdirSync(r.cache), 'something was built into the cache').toEqual([]);
  const said = `took ${Math.round(r.ms)} ms (${Math.round(r.cpuMs)} ms of CPU); starting tsx alone took ${Math.round(baseline.ms)} ms (${Math.round(baseline.cpuMs)} ms of CPU)`;
  expect(r.cpuMs, said).toBeLessThan(baseline.cpuMs + 1200);
  if (baseline.ms < 700) expect(r.ms, said).toBeLessThan(2000);
}

describe('./hutch as a Node CLI', () => {
  it('--version and -V print the version and exit 0', () => {
    const version = (JSON.parse(readFileSync(join(repo, 'package.json'), 'utf8')) as { version: string }).version;
    for (const flag of ['--version', '-V']) {
      const r = hutch([flag]);
      expect(r.code, r.stderr).toBe(0);
      expect(r.stdout).toBe(`${version}\n`);
      atOnce(r);
    }
    const cli = timed(process.execPath, ['--import', 'tsx', 'host-broker/src/cli.ts', '--version']);
    expect(cli.stdout).toBe(`${version}\n`);
  }, 60_000);

  it('serve --port abc and serve --token short exit 2 at once, naming the option, with no image cached', () => {
    const cases: Array<[string[], RegExp]> = [
      [['--port', 'abc'], /--port must be a port number from 0 to 65535/],
      [['--token', 'short'], /--token: a token must be at least 16 characters/],
    ];
    for (const [args, says] of cases) {
      const r = hutch(['serve', ...args, '--data-dir', join(work, 'data')]);
      expect(r.code, r.stderr).toBe(2);
      expect(r.stdout).toBe('');
      expect(r.stderr).toMatch(says);
      expect(r.stderr).not.toMatch(/internal/);
      atOnce(r);
    }
  }, 60_000);

  it('template --help exits 0 at once', () => {
    const r = hutch(['template', '--help']);
    expect(r.code, r.stderr).toBe(0);
    expect(r.stdout).toMatch(/^usage: hutch template <command>/);
    for (const sub of ['build', 'ls', 'inspect', 'rm', 'prune']) expect(r.stdout).toContain(`  ${sub} `);
    atOnce(r);
  }, 60_000);

  it('every command and subcommand has a help of its own, and asking for it installs and builds nothing', () => {
    const helps: Array<[string[], RegExp]> = [
      [['--help'], /^usage: \.\/hutch <command>/],
      [['serve', '--help'], /^usage: hutch serve /],
      [['gateway', '-h'], /^usage: hutch gateway /],
      [['mcp', '--help'], /^usage: hutch mcp /],
      [['setup', '--help'], /^usage: hutch setup /],
      [['prepare', '--help'], /^usage: hutch prepare /],
      [['demo', '--help'], /^usage: hutch demo /],
      [['agent', '--help'], /^usage: hutch-agent /],
      [['test', '--help'], /^usage: \.\/hutch test /],
      ...['build', 'ls', 'inspect', 'rm', 'prune'].map((s): [string[], RegExp] => [['template', s, '--help'], new RegExp(`^usage: hutch template ${s} `)]),
    ];
    for (const [args, usage] of helps) {
      const r = hutch(args);
      expect(r.code, `${args.join(' ')}: ${r.stderr}`).toBe(0);
      expect(r.stdout, args.join(' ')).toMatch(usage);
      expect(existsSync(called) ? readFileSync(called, 'utf8') : '', `${args.join(' ')} ran a set-up tool`).toBe('');
      expect(readdirSync(r.cache), args.join(' ')).toEqual([]);
    }
    // Each help is about its own command: serve's carries neither the gateway's nor MCP's options.
    const serve = hutch(['serve', '--help']).stdout;
    expect(serve).toContain('--port N');
    expect(serve).not.toMatch(/--sample |--url |mcp options|gateway options/);
    expect(serve.split('\n').length).toBeLessThan(80);
  }, 300_000);

  it('every bad option is refused before any work, exit 2, its name in the message', () => {
    const tokens = join(work, 'tokens');
    writeFileSync(tokens, 'alice:alice-token-0123456789\nbob:alice-token-0123456789\n');
    const aFile = join(work, 'a-file');
    writeFileSync(aFile, 'x');
    const cases: Array<[string[], RegExp]> = [
      [['serve', '--port', '70000'], /--port must be a port number/],
      [['serve', '--token', 'has a space in it, long enough'], /--token: a token must be at least 16 characters without spaces/],
      [['serve', '--tokens-file', tokens], /--tokens-file .*reuses another principal's token/],
      [['serve', '--token', 'alice-token-0123456789', '--tokens-file', join(work, 'one')], /--tokens-file .*cannot read it/],
      [['serve', '--data-dir', join(aFile, 'data')], /--data-dir .*is not a directory/],
      [['serve', '--data-dir', '/proc/hutch'], /--data-dir \/proc\/hutch is under \/proc/],
      [['serve', '--level', '5'], /--level must be one of 1, 2, 3, 4, reclaim, prefetch/],
      [['serve', '--log-level', 'loud'], /--log-level must be one of debug, info, warn, error/],
      [['serve', '--standby', '17'], /--standby must be a whole number from 0 to 16/],
      [['serve', '--ready-fd', '1000'], /--ready-fd 1000 is not an open file descriptor/],
      [['serve', '--backend', 'unsafe-local'], /--backend unsafe-local .*--i-know-unsafe-local/],
      [['serve', '--catalog', 'http://redis:6379'], /--catalog must be redis:\/\/HOST:PORT/],
      [['serve', '--prot', '7070'], /unknown option --prot; did you mean --port\?/],
      [['gateway', '--port=-1'], /--port must be a port number/],
      [['mcp', '--url', 'http://127.0.0.1:7070'], /--url must be a broker's ws:\/\/HOST:PORT/],
      [['template', 'build', 'Bad/Name', '--from', 'x.tar'], /template name/i],
      [['template', 'build', 'ok', '--from', 'x.tar', '--memory', 'lots'], /--memory must be a whole number/],
      [['setup', '--log-format', 'xml'], /--log-format must be one of human, json/],
      [['demo', '--sandboxes', 'many'], /--sandboxes must be a whole number/],
      [['agent', '--listen', 'tcp:1'], /--listen/],
    ];
    for (const [args, says] of cases) {
      const r = hutch(args);
      expect(r.code, `${args.join(' ')}: ${r.stderr}`).toBe(2);
      expect(r.stderr, args.join(' ')).toMatch(says);
      expect(r.stderr, args.join(' ')).not.toMatch(/\binternal\b/);
      expect(r.stdout, args.join(' ')).toBe('');
      expect(existsSync(called) ? readFileSync(called, 'utf8') : '', `${args.join(' ')} ran a set-up tool`).toBe('');
      expect(readdirSync(r.cache), args.join(' ')).toEqual([]);
    }
  }, 300_000);

  it('a data dir on a read-only filesystem is refused before any work', () => {
    // A read-only bind mount in a mount namespace of its own: unwritable even for root.
    const ro = mkdtempSync(join(work, 'ro-'));
    const r = spawnSync('unshare', ['-m', 'sh', '-c', `mount --bind -o ro ${ro} ${ro} && exec ./hutch serve --data-dir ${ro}/data`], {
      cwd: repo,
      encoding: 'utf8',
      env: { ...process.env, HUTCH_CACHE: mkdtempSync(join(work, 'cache-')), PATH: `${shims}:${process.env['PATH']}` },
    });
    expect(r.status, r.stderr).toBe(2);
    expect(r.stderr).toMatch(/--data-dir .*\/data: .* is not writable \(EROFS\)/);
    expect(existsSync(called) ? readFileSync(called, 'utf8') : '').toBe('');
  }, 60_000);

  it('a failure while running exits 1', () => {
    // Options fine, the guest image missing and building it off: a runtime failure, not a usage error.
    const r = timed(process.execPath, ['--import', 'tsx', 'host-broker/src/cli.ts', 'serve', '--port', '0', '--data-dir', join(work, 'data-nb'), '--no-build', '--log-level', 'error'], { PATH: process.env['PATH'] });
    expect(r.code, r.stderr).toBe(1);
    expect(r.stderr).toMatch(/^hutch: unavailable: /m);
  }, 120_000);

  it('colours errors only on a terminal, and not with NO_COLOR', () => {
    // `script` gives the command a terminal.
    const onTty = (env: NodeJS.ProcessEnv) => spawnSync('script', ['-qec', './hutch serve --port abc', '/dev/null'], { cwd: repo, encoding: 'utf8', env: { ...process.env, ...env } }).stdout;
    const esc = '\u001b[';
    expect(onTty({})).toContain(esc);
    expect(onTty({ NO_COLOR: '1' })).not.toContain(esc);
    expect(onTty({})).toContain('--port must be a port number');
    expect(hutch(['serve', '--port', 'abc']).stderr).not.toContain(esc);
  }, 60_000);
});

describe('tokens off the command line', () => {
  it('--token-file and HUTCH_TOKEN give serve its token; a token in both places is refused', async () => {
    const file = join(work, 'token');
    writeFileSync(file, 'file-token-0123456789abcdef\n', { mode: 0o600 });
    const started = (args: string[], env: NodeJS.ProcessEnv) =>
      new Promise<{ line: string; stop: () => Promise<void> }>((res, rej) => {
        const p = spawn(process.execPath, ['--import', 'tsx', 'host-broker/src/cli.ts', 'serve', '--port', '0', '--data-dir', join(work, `data-tok-${Math.random()}`), '--backend', 'unsafe-local', '--i-know-unsafe-local', '--ready-json', '--log-level', 'error', ...args], {
          cwd: repo,
          env: { ...process.env, ...env },
          stdio: ['ignore', 'pipe', 'pipe'],
        });
        let out = '';
        let err = '';
        p.stderr.on('data', (d: Buffer) => (err += d.toString()));
        p.stdout.on('data', (d: Buffer) => {
          out += d.toString();
          if (out.includes('\n')) res({ line: out.split('\n')[0] as string, stop: () => new Promise((r) => (p.once('exit', r), p.kill('SIGTERM'))) });
        });
        p.once('exit', (c) => rej(new Error(`exited ${c}: ${err}`)));
      });
    const { Hutch } = await import('../host-broker/src/sdk/index.ts');
    for (const [args, env] of [
      [['--token-file', file], {}],
      [[], { HUTCH_TOKEN: 'file-token-0123456789abcdef' }],
    ] as Array<[string[], NodeJS.ProcessEnv]>) {
      const s = await started(args, env);
      try {
        const ready = JSON.parse(s.line) as { url: string; token?: string };
        expect(ready.token).toBeUndefined();
        const h = await Hutch.connect(ready.url, { token: 'file-token-0123456789abcdef' });
        expect(h.hello.principal).toBe('default');
        h.close();
      } finally {
        await s.stop();
      }
    }
    const both = hutch(['serve', '--token', 'file-token-0123456789abcdef', '--token-file', file]);
    expect(both.code).toBe(2);
    expect(both.stderr).toMatch(/--token or --token-file, not both/);
  }, 120_000);
});
