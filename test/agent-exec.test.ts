import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { existsSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { HutchError } from '../guest-agent/src/protocol/errors.ts';
import { startAgent, type AgentProcess } from './helpers/agent-process.ts';

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    // A zombie still answers kill(0); treat it as dead.
    return !/^State:\s+Z/m.test(readFileSync(`/proc/${pid}/status`, 'utf8'));
  } catch {
    return false;
  }
}

async function waitDead(pid: number, ms = 3000): Promise<boolean> {
  const deadline = Date.now() + ms;
  while (Date.now() < deadline) {
    if (!alive(pid)) return true;
    await new Promise((r) => setTimeout(r, 25));
  }
  return false;
}

/** Processes whose process group is `pgid`, after giving a group kill a moment to land. */
async function countProcessesInGroup(pgid: number): Promise<number> {
  await new Promise((r) => setTimeout(r, 300));
  let n = 0;
  for (const p of readdirSync('/proc')) {
    if (!/^\d+$/.test(p)) continue;
    try {
      const stat = readFileSync(`/proc/${p}/stat`, 'utf8');
      const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
      if (Number(fields[2]) === pgid && fields[0] !== 'Z') n++;
    } catch {
      // exited while we looked
    }
  }
  return n;
}

describe('exec', () => {
  let agent: AgentProcess;
  beforeAll(async () => {
    agent = await startAgent();
  });
  afterAll(async () => agent.stop());

  it('runs bash -c in the workspace and reports exit code, stdout and stderr separately', async () => {
    writeFileSync(join(agent.root, 'f.txt'), 'content\n');
    const r = await agent.client.run({ command: 'cat f.txt; echo oops >&2; pwd; exit 7' });
    expect(r.exitCode).toBe(7);
    expect(r.signal).toBeNull();
    expect(r.stdoutText).toBe(`content\n${agent.root}\n`);
    expect(r.stderrText).toBe('oops\n');
  });

  it('runs an argv without a shell, with env and cwd', async () => {
    await agent.client.call('fs.mkdir', { path: 'sub/dir', parents: true });
    const r = await agent.client.run({ argv: ['sh', '-c', 'echo "$GREETING from $(basename "$PWD")"'], cwd: 'sub/dir', env: { GREETING: 'hi' } });
    expect(r.stdoutText).toBe('hi from dir\n');
  });

  it('streams output as it is produced, before the process ends', async () => {
    const times: number[] = [];
    const t0 = Date.now();
    const r = await agent.client.exec({ command: 'echo one; sleep 0.6; echo two', onStdout: () => void times.push(Date.now() - t0) }).result;
    expect(r.exitCode).toBe(0);
    expect(times.length).toBe(2);
    expect((times[1] as number) - (times[0] as number)).toBeGreaterThan(300);
  });

  it('feeds stdin, inline and streamed', async () => {
    expect((await agent.client.run({ command: 'tr a-z A-Z', stdin: Buffer.from('shout\n') })).stdoutText).toBe('SHOUT\n');
    const big = Buffer.alloc(5 * 1024 * 1024, 'x');
    const r = await agent.client.run({
      command: 'wc -c',
      stdin: (async function* () {
        for (let o = 0; o < big.length; o += 100_000) yield big.subarray(o, o + 100_000);
      })(),
    });
    expect(r.stdoutText.trim()).toBe(String(big.length));
  });

  it('reports death by signal', async () => {
    const r = await agent.client.run({ command: 'kill -TERM $$' });
    expect(r.exitCode).toBeNull();
    expect(r.signal).toBe('SIGTERM');
  });

  it('a timeout kills the whole process group, grandchildren included', async () => {
    const r = await agent.client.run({
      command: '(sleep 300; echo never) & echo $! > bg.pid; bash -c "sleep 300" & echo $! > bg2.pid; sleep 300',
      timeoutMs: 700,
    });
    expect(r.timedOut).toBe(true);
    const pids = ['bg.pid', 'bg2.pid'].map((f) => Number(readFileSync(join(agent.root, f), 'utf8')));
    for (const pid of pids) expect(await waitDead(pid)).toBe(true);
  });

  it('kills a running command on request (signal and cancel)', async () => {
    const h = agent.client.exec({ command: 'trap "echo got-int; exit 42" INT; echo ready; while true; do sleep 0.05; done', onStdout: async () => undefined });
    await new Promise((r) => setTimeout(r, 300));
    expect(await h.signal('SIGINT')).toBe(true);
    const r = await h.result;
    expect(r.exitCode).toBe(42);

    const ac = new AbortController();
    const h2 = agent.client.exec({ command: 'sleep 300 & echo $! > c.pid; wait', signal: ac.signal });
    await new Promise((r) => setTimeout(r, 300));
    ac.abort();
    await expect(h2.result).rejects.toMatchObject({ code: 'cancelled' });
    expect(await waitDead(Number(readFileSync(join(agent.root, 'c.pid'), 'utf8')))).toBe(true);
  });

  it('caps output: keeps the first bytes, counts them all, flags truncation', async () => {
    const r = await agent.client.run({ command: 'head -c 3000000 /dev/zero | tr "\\0" a; echo -n err >&2', maxOutputBytes: 1000 });
    expect(r.stdout).toEqual({ bytes: 3_000_000, kept: 1000, truncated: true });
    expect(r.stdoutText.length).toBe(1000);
    expect(r.stderr).toEqual({ bytes: 3, kept: 3, truncated: false });
  });

  it('does not wait forever for a background child that keeps stdout open', async () => {
    const r = await agent.client.run({ command: 'sleep 30 & echo started', timeoutMs: 20_000 });
    expect(r.exitCode).toBe(0);
    expect(r.stdoutText).toBe('started\n');
    expect(r.timedOut).toBe(false);
  });

  it('contains a fork bomb: limited by RLIMIT_NPROC as an unprivileged user, killed with its call', async () => {
    // Never run a fork bomb as root on the host: root ignores RLIMIT_NPROC. As nobody the
    // bomb hits the limit, and --kill-on-exit removes every survivor when the call ends.
    const nobody = await startAgent({ args: ['--run-as', '65534:65534'], owner: 65534 });
    try {
      const r = await nobody.client.run({ command: 'ulimit -u 64; b() { b | b & }; b; sleep 1; echo $$ > leader.pid', timeoutMs: 10_000 });
      expect(r.exitCode).toBe(0);
      const leader = Number(readFileSync(join(nobody.root, 'leader.pid'), 'utf8'));
      const left = await countProcessesInGroup(leader);
      expect(left).toBe(0);
      expect((await nobody.client.call('ping', {})).uptimeMs).toBeGreaterThan(0);
    } finally {
      await nobody.stop();
    }
  });

  it('refuses a cwd outside the workspace and an unknown program with typed errors', async () => {
    await expect(agent.client.run({ command: 'pwd', cwd: '../..' })).rejects.toMatchObject({ code: 'outside_workspace' });
    await expect(agent.client.run({ argv: ['/no/such/program'] })).rejects.toMatchObject({ code: 'not_found' });
    await expect(agent.client.run({ command: 'true', cwd: 'missing-dir' })).rejects.toBeInstanceOf(HutchError);
    expect(existsSync(join(agent.root, '..', 'pwned'))).toBe(false);
  });

  it('fails in-flight calls with connection_closed when the agent dies', async () => {
    const other = await startAgent();
    const h = other.client.exec({ command: 'sleep 30' });
    await new Promise((r) => setTimeout(r, 200));
    other.proc.kill('SIGKILL');
    await expect(h.result).rejects.toMatchObject({ code: 'connection_closed' });
    await other.stop();
  });
});
