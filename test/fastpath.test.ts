import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { chmodSync, existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, statSync, symlinkSync, writeFileSync } from 'node:fs';
import { createServer, type Server } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { noopLogger } from '../guest-agent/src/log.ts';
import { HutchError } from '../guest-agent/src/protocol/errors.ts';
import { FastPath, type FastPathRequest, type FastPathResult } from '../host-broker/src/fastpath/index.ts';
import { ownDir, parseMountinfo, parseProcCgroup } from '../host-broker/src/fastpath/cgroup-detect.ts';

/**
 * The fast path with real bubblewrap, real seccomp, real cgroups (or whatever this host
 * offers: describe() says), on a real workspace directory.
 */

interface Run extends FastPathResult {
  out: string;
  err: string;
}

async function run(fp: FastPath, req: Omit<FastPathRequest, 'onStdout' | 'onStderr'>): Promise<Run> {
  let out = '';
  let err = '';
  const r = await fp.run({ ...req, onStdout: (c) => void (out += c.toString()), onStderr: (c) => void (err += c.toString()) });
  return { ...r, out, err };
}

/** Host processes whose command line contains `marker` (the sandbox is a pid namespace, so look from outside). */
function hostProcessesWith(marker: string): number[] {
  const found: number[] = [];
  for (const p of readdirSync('/proc')) {
    if (!/^\d+$/.test(p)) continue;
    try {
      const cmdline = readFileSync(`/proc/${p}/cmdline`, 'utf8');
      const state = /^State:\s+(\S)/m.exec(readFileSync(`/proc/${p}/status`, 'utf8'))?.[1];
      if (cmdline.includes(marker) && state !== 'Z' && Number(p) !== process.pid) found.push(Number(p));
    } catch {
      // exited while we looked
    }
  }
  return found;
}

async function eventually(check: () => boolean, ms = 3000): Promise<boolean> {
  const deadline = Date.now() + ms;
  while (Date.now() < deadline) {
    if (check()) return true;
    await new Promise((r) => setTimeout(r, 50));
  }
  return check();
}

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

const SECRET_ENV = 'HUTCH_TEST_HOST_SECRET';

describe('fast path', () => {
  let fp: FastPath;
  let root: string;
  let ws: string;

  beforeAll(async () => {
    process.env[SECRET_ENV] = 'do-not-leak-7f3a';
    root = mkdtempSync(join(tmpdir(), 'hutch-fastpath-test-'));
    chmodSync(root, 0o755);
    ws = join(root, 'ws');
    mkdirSync(join(ws, 'src', 'deep'), { recursive: true });
    writeFileSync(join(ws, 'a.txt'), 'hello\n');
    writeFileSync(join(ws, 'src', 'deep', 'x.ts'), 'export const x = 1;\n');
    writeFileSync(join(root, 'outside.txt'), 'outside the workspace\n');
    symlinkSync('/etc/shadow', join(ws, 'shadow-link'));
    symlinkSync('/proc/1/root/etc/shadow', join(ws, 'proc-link'));
    symlinkSync('../outside.txt', join(ws, 'up-link'));
    symlinkSync('/etc', join(ws, 'etc-dir-link'));
    fp = await FastPath.create({ log: noopLogger });
  });

  afterAll(async () => {
    await fp?.close();
    delete process.env[SECRET_ENV];
    if (root) rmSync(root, { recursive: true, force: true });
  });

  describe('runs commands in the workspace', () => {
    it('runs in /work as a non-root user and sees the workspace', async () => {
      const r = await run(fp, { command: 'pwd; id -u; id -g; cat a.txt; ls src', workspace: ws });
      expect(r.exitCode).toBe(0);
      expect(r.out).toBe('/work\n1000\n1000\nhello\ndeep\n');
    });

    it('runs in a workspace-relative cwd', async () => {
      const r = await run(fp, { command: 'pwd; cat x.ts', workspace: ws, cwd: 'src/deep' });
      expect(r.out).toBe('/work/src/deep\nexport const x = 1;\n');
      const abs = await run(fp, { command: 'pwd', workspace: ws, cwd: '/work/src' });
      expect(abs.out).toBe('/work/src\n');
    });

    it('edits land in the host workspace', async () => {
      const r = await run(fp, { command: "echo edited > new.txt && sed -i 's/hello/HELLO/' a.txt && mkdir -p made/dir", workspace: ws });
      expect(r.exitCode).toBe(0);
      expect(readFileSync(join(ws, 'new.txt'), 'utf8')).toBe('edited\n');
      expect(readFileSync(join(ws, 'a.txt'), 'utf8')).toBe('HELLO\n');
      expect(existsSync(join(ws, 'made', 'dir'))).toBe(true);
      writeFileSync(join(ws, 'a.txt'), 'hello\n');
    });

    it('runs read tools (grep, find, sed, awk, git) with a private writable /tmp', async () => {
      const r = await run(fp, {
        command: 'grep -rn "const" src; find . -name "*.ts"; echo scratch > /tmp/s && cat /tmp/s; awk "BEGIN { print 6 * 7 }"; git init -q . && git status --short | head -3',
        workspace: ws,
      });
      expect(r.err).toBe('');
      expect(r.out).toContain('src/deep/x.ts:1:export const x = 1;');
      expect(r.out).toContain('./src/deep/x.ts');
      expect(r.out).toContain('scratch\n42\n');
      expect(r.out).toMatch(/\?\? a\.txt/);
      rmSync(join(ws, '.git'), { recursive: true, force: true });
    });

    it('passes stdin, exit codes, signals and the requested environment; hides the broker environment', async () => {
      const input = Buffer.alloc(12_345, 'x');
      expect((await run(fp, { command: 'wc -c', workspace: ws, stdin: input })).out.trim()).toBe('12345');
      expect((await run(fp, { command: 'exit 7', workspace: ws })).exitCode).toBe(7);
      expect((await run(fp, { command: 'kill -TERM $$', workspace: ws })).exitCode).toBe(128 + 15);
      const env = await run(fp, { command: 'env', workspace: ws, env: { FOO: 'bar' } });
      expect(env.out).toContain('FOO=bar\n');
      expect(env.out).toContain('HOME=/home/tenant\n');
      expect(env.out).not.toContain(SECRET_ENV);
    });

    it('caps output per stream and counts what it dropped', async () => {
      const r = await run(fp, { command: 'head -c 100000 /dev/zero; echo err >&2', workspace: ws, maxOutputBytes: 1000 });
      expect(r.exitCode).toBe(0);
      expect(r.stdout).toEqual({ bytes: 100_000, kept: 1000, truncated: true });
      expect(r.out.length).toBe(1000);
      expect(r.err).toBe('err\n');
    });

    it('streams output with backpressure: a slow consumer still gets every byte, in order', async () => {
      const chunks: Buffer[] = [];
      const r = await fp.run({
        command: 'seq 1 200000',
        workspace: ws,
        onStdout: async (c) => {
          chunks.push(Buffer.from(c));
          await new Promise((res) => setTimeout(res, 1));
        },
      });
      const text = Buffer.concat(chunks).toString();
      expect(r.exitCode).toBe(0);
      expect(text.split('\n').length).toBe(200_001);
      expect(text.endsWith('199999\n200000\n')).toBe(true);
    });

    it('a consumer that stops taking output stops the command: the output in flight is bounded, and the sink is called one chunk at a time', async () => {
      // The command prints 1 KiB lines and notes every 64th line's number in the workspace.
      const progress = join(ws, 'progress');
      let calls = 0;
      let release!: () => void;
      const stalled = new Promise<void>((r) => (release = r));
      const abort = new AbortController();
      const running = fp.run({
        command: 'i=0; while :; do i=$((i+1)); printf "%1023d\\n" $i; [ $((i % 64)) = 0 ] && echo $i > progress; done',
        workspace: ws,
        signal: abort.signal,
        onStdout: async () => {
          calls++;
          await stalled; // never taken until the end of the test
        },
      });
      await new Promise((r) => setTimeout(r, 1500));
      const lines = Number(existsSync(progress) ? readFileSync(progress, 'utf8').trim() : '0');
      const callsWhileStalled = calls;
      abort.abort();
      release();
      const r = await running;
      expect(r.cancelled).toBe(true);
      expect(callsWhileStalled).toBe(1);
      // Unbounded, the loop writes tens of MiB in that time; the helper's credit window plus
      // the pipe hold well under 2 MiB.
      expect(lines).toBeLessThan(2048);
      rmSync(progress, { force: true });
    });

    it('runs calls concurrently, each with its own output and cgroup', async () => {
      const runs = await Promise.all([0, 1, 2, 3].map((i) => run(fp, { command: `sleep 0.2; echo run-${i}; echo err-${i} >&2`, workspace: ws })));
      runs.forEach((r, i) => {
        expect(r.out).toBe(`run-${i}\n`);
        expect(r.err).toBe(`err-${i}\n`);
      });
    });

    it('reports the limits it ran under', async () => {
      const r = await run(fp, { command: 'true', workspace: ws });
      const d = fp.describe();
      expect(r.limits.mechanism).toBe(d.limits.mechanism);
      expect(r.limits.oomKilled).toBe(false);
      expect(r.limits.processLimitHit).toBe(false);
      if (d.limits.mechanism === 'cgroup-v1') expect(r.limits.peakMemoryBytes).toBeGreaterThan(0);
      expect(d.seccomp.refused).toBe('EPERM');
      expect(d.bwrap.flags).toEqual(expect.arrayContaining(['--unshare-all', '--unshare-user', '--disable-userns', '--die-with-parent', '--new-session', '--clearenv', '--seccomp']));
    });
  });

  describe('rejects bad requests with typed errors', () => {
    const code = async (req: FastPathRequest): Promise<string> => {
      try {
        await fp.run(req);
        return 'no error';
      } catch (err) {
        expect(err).toBeInstanceOf(HutchError);
        return (err as HutchError).code;
      }
    };

    it('empty command, missing workspace, bad env, bad timeout', async () => {
      expect(await code({ command: '  ', workspace: ws })).toBe('bad_request');
      expect(await code({ command: 'ls', workspace: join(root, 'missing') })).toBe('not_found');
      expect(await code({ command: 'ls', workspace: ws, env: { 'A=B': 'x' } })).toBe('bad_request');
      expect(await code({ command: 'ls', workspace: ws, timeoutMs: 0 })).toBe('bad_request');
    });

    it('a cwd outside the workspace, through .., an absolute path or a symlink', async () => {
      expect(await code({ command: 'ls', workspace: ws, cwd: '../' })).toBe('outside_workspace');
      expect(await code({ command: 'ls', workspace: ws, cwd: '/etc' })).toBe('outside_workspace');
      expect(await code({ command: 'ls', workspace: ws, cwd: 'etc-dir-link' })).toBe('outside_workspace');
      expect(await code({ command: 'ls', workspace: ws, cwd: 'a.txt' })).toBe('not_a_directory');
      expect(await code({ command: 'ls', workspace: ws, cwd: 'nope' })).toBe('not_found');
    });
  });

  describe('escapes fail', () => {
    it('cannot write outside /work and /tmp', async () => {
      const marker = `hutch-escape-${process.pid}`;
      const r = await run(fp, {
        command: `for p in /usr/${marker} /etc/${marker} /${marker} /bin/${marker} /proc/${marker} /dev/${marker}; do touch "$p" 2>/dev/null && echo "WROTE $p"; done; echo end`,
        workspace: ws,
      });
      expect(r.out).toBe('end\n');
      for (const p of [`/usr/${marker}`, `/etc/${marker}`, `/${marker}`, `/tmp/${marker}`]) expect(existsSync(p), p).toBe(false);
    });

    it('cannot write sysctls or read root-only kernel files (the sandbox user is uid 0 on the host)', async () => {
      const before = readFileSync('/proc/sys/kernel/core_pattern', 'utf8');
      // Writes back the value it read: harmless on the host even if the guard failed.
      const r = await run(fp, {
        command: [
          'cat /proc/sys/kernel/core_pattern > /proc/sys/kernel/core_pattern && echo SYSCTL-WRITTEN',
          'cat /proc/sys/vm/swappiness > /proc/sys/vm/swappiness && echo SYSCTL-WRITTEN',
          '[ -w /proc/sysrq-trigger ] && echo SYSRQ-WRITABLE',
          'for f in /proc/slabinfo /proc/vmallocinfo /proc/timer_list /proc/keys /proc/kpageflags /proc/pagetypeinfo; do [ -e $f ] && echo "$f $(head -c 64 $f 2>/dev/null | wc -c)"; done',
          'cat /proc/sys/kernel/ostype',
        ].join('; '),
        workspace: ws,
      });
      expect(r.out).not.toMatch(/SYSCTL-WRITTEN|SYSRQ-WRITABLE/);
      expect(r.err).toContain('Read-only file system');
      // No procfs in the fast path (bwrap-argv.ts, PROC_EXPOSED): the root-only kernel files are not there at all;
      // the sysctls stay readable.
      expect(r.out).toBe('Linux\n');
      expect(readFileSync('/proc/sys/kernel/core_pattern', 'utf8')).toBe(before);
    });

    it('cannot leave set-user-ID files in the workspace (they would belong to root on the host)', async () => {
      const r = await run(fp, {
        command: [
          'echo x > tool',
          'chmod u+s tool 2>/dev/null || echo chmod-refused',
          'chmod g+s tool 2>/dev/null || echo chmod-g-refused',
          'chmod 0755 tool && echo chmod-ok',
          `perl -e 'use Fcntl; sysopen(my $f, "tool2", O_CREAT|O_WRONLY, 04755) ? print "CREATED\\n" : print "create: $!\\n"'`,
        ].join('; '),
        workspace: ws,
      });
      expect(r.out).toBe('chmod-refused\nchmod-g-refused\nchmod-ok\ncreate: Operation not permitted\n');
      expect(statSync(join(ws, 'tool')).mode & 0o7777).toBe(0o755);
      expect(existsSync(join(ws, 'tool2'))).toBe(false);
    });

    it('cannot read /root, /etc/shadow or the host /etc, directly or through workspace symlinks', async () => {
      const hostShadow = readFileSync('/etc/shadow', 'utf8');
      const rootLine = hostShadow.split('\n').find((l) => l.startsWith('root:')) ?? 'root:';
      const r = await run(fp, {
        command: 'ls /root; cat /etc/shadow; cat shadow-link; cat proc-link; cat up-link; cat etc-dir-link/shadow; ls /etc; echo end',
        workspace: ws,
      });
      const seen = r.out + r.err;
      expect(seen).not.toContain(rootLine);
      expect(seen).not.toContain('outside the workspace');
      expect(r.out.endsWith('end\n')).toBe(true);
      // Only the generated /etc: no shadow, no ssh, no host passwd entries.
      const etc = r.out.split('\n');
      expect(etc).toContain('passwd');
      expect(etc).not.toContain('shadow');
      expect(etc).not.toContain('ssh');
      const passwd = await run(fp, { command: 'cat /etc/passwd', workspace: ws });
      expect(passwd.out).toContain('user:x:1000:1000:');
      expect(passwd.out).not.toContain(readFileSync('/etc/passwd', 'utf8').split('\n')[1] ?? 'never');
    });

    describe('network', () => {
      let server: Server;
      let port = 0;
      let connections = 0;
      beforeAll(async () => {
        server = createServer((s) => {
          connections++;
          s.end('hello from the host\n');
        });
        await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
        const addr = server.address();
        port = typeof addr === 'object' && addr ? addr.port : 0;
      });
      afterAll(() => new Promise<void>((r) => server.close(() => r())));

      it('cannot connect to a TCP server on the host', async () => {
        const r = await run(fp, { command: `exec 3<>/dev/tcp/127.0.0.1/${port} && cat <&3 && echo CONNECTED`, workspace: ws, timeoutMs: 10_000 });
        expect(r.out).not.toContain('CONNECTED');
        expect(r.out).not.toContain('hello from the host');
        expect(r.exitCode).not.toBe(0);
        expect(connections).toBe(0);
        const ifaces = await run(fp, { command: 'ip -o link 2>/dev/null || /usr/sbin/ip -o link', workspace: ws }); // no /sys, no procfs: netlink
        expect(ifaces.out).toContain('lo');
        expect(ifaces.out).not.toMatch(/eth|ens|enp|wl/);
      });
    });

    it('cannot unshare, mount, ptrace or use keyrings', async () => {
      const r = await run(fp, {
        command: [
          'unshare -U true && echo UNSHARED',
          'unshare -m true && echo UNSHARED_NS',
          'mount -t tmpfs none /tmp && echo MOUNTED',
          // perl is Essential in Debian; its syscall() reaches ptrace(PTRACE_TRACEME) and keyctl directly.
          `perl -e 'syscall(101, 0, 0, 0, 0) == -1 ? print "ptrace: $!\\n" : print "PTRACED\\n"'`,
          `perl -e 'syscall(250, 0, -3, 0) == -1 ? print "keyctl: $!\\n" : print "KEYCTL\\n"'`,
          'echo end',
        ].join('; '),
        workspace: ws,
      });
      expect(r.out).not.toMatch(/UNSHARED|MOUNTED|PTRACED|KEYCTL/);
      expect(r.out).toContain('ptrace: Operation not permitted\n');
      expect(r.out).toContain('keyctl: Operation not permitted\n');
      expect(r.out.endsWith('end\n')).toBe(true);
    });

    it("cannot see or kill the broker's processes", async () => {
      const helper = fp.describe().spawner.pid;
      const r = await run(fp, { command: `kill -9 ${process.pid} ${helper}; kill -9 -1; ps -e -o pid= | wc -l; echo end`, workspace: ws });
      expect(alive(process.pid)).toBe(true);
      expect(alive(helper)).toBe(true);
      expect(r.err).toContain('No such process');
      // Later runs still work: the spawn helper is unharmed.
      expect((await run(fp, { command: 'echo still here', workspace: ws })).out).toBe('still here\n');
    });
  });

  describe('nothing of a run outlives it', () => {
    it('background and setsid processes are gone when the run returns', async () => {
      const marker = `hutch-linger-${process.pid}-${Date.now()}`;
      const r = await run(fp, { command: `(exec -a ${marker} sleep 60 &); setsid bash -c 'exec -a ${marker} sleep 60' >/dev/null 2>&1 < /dev/null & echo started`, workspace: ws });
      expect(r.out).toBe('started\n');
      expect(await eventually(() => hostProcessesWith(marker).length === 0)).toBe(true);
    });

    it('a timeout kills everything the command started', async () => {
      const marker = `hutch-timeout-${process.pid}-${Date.now()}`;
      const r = await run(fp, { command: `for i in 1 2 3; do bash -c 'exec -a ${marker} sleep 60' & done; exec -a ${marker} sleep 60`, workspace: ws, timeoutMs: 1000 });
      // Without the kill the run would last the sleeps' 60 s, past this test's own timeout.
      expect(r.timedOut).toBe(true);
      expect(await eventually(() => hostProcessesWith(marker).length === 0)).toBe(true);
    });

    it('a cancelled run is killed', async () => {
      const ac = new AbortController();
      setTimeout(() => ac.abort(), 300);
      const r = await run(fp, { command: 'sleep 60', workspace: ws, signal: ac.signal });
      expect(r.cancelled).toBe(true);
    });
  });
});

// Both ways into a run's cgroup: the spawn helper forking from inside it (cgroup v1), and the
// `sh` step the in-process spawner uses.
describe.each(['helper', 'in-process'] as const)('fast path limits (%s spawner)', (spawner) => {
  let fp: FastPath;
  let ws: string;

  beforeAll(async () => {
    ws = mkdtempSync(join(tmpdir(), 'hutch-fastpath-limits-'));
    chmodSync(ws, 0o755);
    fp = await FastPath.create({ log: noopLogger, maxProcesses: 16, memoryBytes: 64 * 1024 * 1024, spawner });
  });
  afterAll(async () => {
    await fp?.close();
    if (ws) rmSync(ws, { recursive: true, force: true });
  });

  it('describes the mechanism in force', () => {
    const d = fp.describe().limits;
    expect(['cgroup-v2', 'cgroup-v1', 'rlimit']).toContain(d.mechanism);
    expect(d.maxProcesses).toBe(16);
    if (d.mechanism !== 'rlimit') expect(d.cgroupParents.length).toBeGreaterThan(0);
  });

  it('contains a (bounded) fork bomb with the process limit', async (ctx) => {
    const d = fp.describe().limits;
    if (!d.processLimitEnforced) ctx.skip(`the process limit does not hold with ${d.mechanism} here: ${d.notes.join('; ')}`);
    // At most 2^7 - 1 = 127 processes even if no limit held; the limit is 16.
    const r = await run(fp, { command: 'f(){ if [ $1 -gt 0 ]; then f $(($1-1)) & f $(($1-1)) & wait; else sleep 1; fi; }; f 6; echo done', workspace: ws, timeoutMs: 4000 });
    expect(r.limits.processLimitHit).toBe(true);
    expect(r.err).toMatch(/fork|Resource temporarily unavailable/);
    // The broker is fine and the next run gets a clean slot.
    const next = await run(fp, { command: 'echo ok', workspace: ws });
    expect(next.out).toBe('ok\n');
    expect(next.limits.processLimitHit).toBe(false);
    // The forker went back to its own cgroups after starting the sandbox.
    const forker = fp.describe().spawner.pid;
    expect(readFileSync(`/proc/${forker}/cgroup`, 'utf8')).not.toContain('hutch-fastpath');
  });

  it('kills a command that exceeds the memory limit (tmpfs pages count too)', async (ctx) => {
    const d = fp.describe().limits;
    if (d.mechanism === 'rlimit') ctx.skip('rlimit bounds address space per process, not the sandbox: no OOM kill to observe');
    const r = await run(fp, { command: 'head -c 200000000 /dev/zero > /tmp/big; echo survived', workspace: ws, timeoutMs: 30_000 });
    expect(r.limits.oomKilled).toBe(true);
    expect(r.out).not.toContain('survived');
    const next = await run(fp, { command: 'echo ok', workspace: ws });
    expect(next.limits.oomKilled).toBe(false);
  });

  it('removes its cgroups when closed', async (ctx) => {
    const parents = fp.describe().limits.cgroupParents;
    if (parents.length === 0) ctx.skip('no cgroups in use here (rlimit mechanism)');
    const extra = await FastPath.create({ log: noopLogger, spawner });
    await run(extra, { command: 'true', workspace: ws });
    // Each fast path has a pool of its own, its slots below it.
    const pools = extra.describe().limits.cgroupParents;
    expect(pools.some((p) => parents.includes(p))).toBe(false);
    expect(pools.flatMap((dir) => readdirSync(dir).filter((n) => n.startsWith(`slot-${process.pid}-`))).length).toBeGreaterThan(0);
    await extra.close();
    // extra's pool is gone; `fp`'s stays.
    expect(pools.filter((p) => existsSync(p))).toEqual([]);
    expect(parents.filter((p) => existsSync(p))).toEqual(parents);
  });
});

describe('fast path spawn helper', () => {
  it('fails the runs in flight when the helper dies, then starts a new one', async () => {
    const ws = mkdtempSync(join(tmpdir(), 'hutch-fastpath-helper-'));
    const fp = await FastPath.create({ log: noopLogger });
    try {
      const first = fp.describe().spawner.pid;
      const marker = `hutch-orphan-${process.pid}-${Date.now()}`;
      const inFlight = fp.run({ command: `exec -a ${marker} sleep 30`, workspace: ws });
      await new Promise((r) => setTimeout(r, 500));
      process.kill(first, 'SIGKILL');
      await expect(inFlight).rejects.toMatchObject({ code: 'internal' });
      const r = await run(fp, { command: 'echo back', workspace: ws });
      expect(r.out).toBe('back\n');
      expect(fp.describe().spawner.pid).not.toBe(first);
      // The sandbox died with its helper (--die-with-parent), not left behind.
      expect(await eventually(() => hostProcessesWith(marker).length === 0)).toBe(true);
    } finally {
      await fp.close();
      rmSync(ws, { recursive: true, force: true });
    }
  });
});

describe('fast path rlimit fallback', () => {
  it('runs commands under rlimits and says the process limit does not hold for a root broker', async () => {
    const ws = mkdtempSync(join(tmpdir(), 'hutch-fastpath-rlimit-'));
    const fp = await FastPath.create({ log: noopLogger, limitMechanism: 'rlimit', spawner: 'in-process', maxProcesses: 32, memoryBytes: 256 * 1024 * 1024 });
    try {
      const d = fp.describe().limits;
      expect(d.mechanism).toBe('rlimit');
      expect(d.processLimitEnforced).toBe(process.getuid?.() !== 0);
      const r = await run(fp, { command: 'ulimit -u; ulimit -v', workspace: ws });
      expect(r.out).toBe(`32\n${256 * 1024}\n`);
      expect(r.limits.mechanism).toBe('rlimit');
    } finally {
      await fp.close();
      rmSync(ws, { recursive: true, force: true });
    }
  });
});

describe('cgroup detection', () => {
  it('finds the broker cgroup on a cgroup v2 host', () => {
    const mounts = parseMountinfo('29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n');
    const own = parseProcCgroup('0::/system.slice/hutch.service\n');
    const v2 = mounts[0];
    expect(v2).toMatchObject({ fstype: 'cgroup2', mountPoint: '/sys/fs/cgroup', root: '/' });
    expect(ownDir({ mounts, own }, v2!)).toBe('/sys/fs/cgroup/system.slice/hutch.service');
  });

  it('finds each v1 controller hierarchy on a hybrid host, co-mounted ones included', () => {
    const mounts = parseMountinfo(
      [
        '34 30 0:31 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory',
        '38 30 0:35 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids',
        '31 30 0:28 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct',
        '40 30 0:37 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw',
      ].join('\n'),
    );
    const own = parseProcCgroup('8:pids:/\n4:memory:/process_api/abc\n2:cpu,cpuacct:/x\n0::/\n');
    const byPoint = (p: string) => mounts.find((m) => m.mountPoint === p)!;
    expect(byPoint('/sys/fs/cgroup/memory').controllers).toEqual(['memory']);
    expect(ownDir({ mounts, own }, byPoint('/sys/fs/cgroup/memory'))).toBe('/sys/fs/cgroup/memory/process_api/abc');
    expect(ownDir({ mounts, own }, byPoint('/sys/fs/cgroup/pids'))).toBe('/sys/fs/cgroup/pids');
    expect(ownDir({ mounts, own }, byPoint('/sys/fs/cgroup/cpu,cpuacct'))).toBe('/sys/fs/cgroup/cpu,cpuacct/x');
  });

  it('reads paths relative to a mount that is not the hierarchy root (containers)', () => {
    const mounts = parseMountinfo('50 40 0:40 /docker/abc /sys/fs/cgroup/pids ro - cgroup cgroup rw,pids\n');
    const own = parseProcCgroup('5:pids:/docker/abc/sub\n');
    expect(ownDir({ mounts, own }, mounts[0]!)).toBe('/sys/fs/cgroup/pids/sub');
  });
});
