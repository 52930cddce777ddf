import { afterEach, describe, expect, it } from 'vitest';
import { spawn, type ChildProcess } from 'node:child_process';
import { copyFileSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { processGone, procStat } from '../host-broker/src/util/process-gone.ts';

/**
 * Waiting for a process that is not our child (the QEMU inside a bwrap wrapper, whose exit
 * the broker cannot observe directly): real processes, real /proc.
 */
const children: ChildProcess[] = [];
function sleeper(file = 'sleep'): ChildProcess {
  const c = spawn(file, ['1000'], { stdio: 'ignore' });
  children.push(c);
  return c;
}
afterEach(() => {
  for (const c of children.splice(0)) c.kill('SIGKILL');
});
const exited = (c: ChildProcess) => new Promise((r) => (c.exitCode !== null || c.signalCode !== null ? r(undefined) : c.once('exit', r)));

describe('procStat', () => {
  it('reads the state and start time, also behind a command name with spaces and parentheses', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'hutch-gone-'));
    try {
      const odd = join(dir, 'a) b (c');
      copyFileSync('/bin/sleep', odd);
      const plain = sleeper();
      const tricky = sleeper(odd);
      await new Promise((r) => setTimeout(r, 100));
      const p = procStat(plain.pid as number);
      const t = procStat(tricky.pid as number);
      expect(p?.state).toBe('S');
      expect(t?.state).toBe('S');
      expect(Number.isInteger(p?.startTicks)).toBe(true);
      expect(t?.startTicks).toBeGreaterThanOrEqual(p?.startTicks as number);
      expect(procStat(2 ** 22 + 1)).toBeUndefined();
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe('processGone', () => {
  it('is true once the process has exited, and at once for a pid that is gone or reused', async () => {
    const c = sleeper();
    const st = procStat(c.pid as number);
    expect(st).toBeDefined();
    const gone = processGone(c.pid as number, st?.startTicks as number, { killAfterMs: 60_000, giveUpMs: 60_000 });
    c.kill('SIGTERM');
    expect(await gone).toBe(true);
    await exited(c);
    expect(await processGone(c.pid as number, st?.startTicks as number)).toBe(true);
    // Same pid, another start time: another process, so the one waited for is gone.
    const other = sleeper();
    expect(await processGone(other.pid as number, (procStat(other.pid as number)?.startTicks as number) - 1)).toBe(true);
    expect(['R', 'S']).toContain(procStat(other.pid as number)?.state);
  });

  it('kills a process that outstays killAfterMs, and gives up (false) on one still there at giveUpMs', async () => {
    const stubborn = sleeper();
    const st = procStat(stubborn.pid as number)?.startTicks as number;
    expect(await processGone(stubborn.pid as number, st, { killAfterMs: 60_000, giveUpMs: 200 })).toBe(false);
    expect(['R', 'S']).toContain(procStat(stubborn.pid as number)?.state);
    expect(await processGone(stubborn.pid as number, st, { killAfterMs: 50, giveUpMs: 10_000 })).toBe(true);
    await exited(stubborn);
    expect(stubborn.signalCode).toBe('SIGKILL');
  });
});
