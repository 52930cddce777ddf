import { spawn } from 'node:child_process';
import { chmodSync, existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { HutchError } from '../guest-agent/src/protocol/errors.ts';
import { openStateReceiver } from '../host-broker/src/vm/state-receiver.ts';

const VM_UID = 2_100_009_001;
const OTHER_UID = 2_100_009_002;
const work = mkdtempSync(join(tmpdir(), 'hutch-state-rx-'));
afterAll(() => rmSync(work, { recursive: true, force: true }));

/**
 * Connects to `path` as `uid` in a separate process and sends `data`; resolves its exit
 * code and stderr (`#N` sends N bytes of x). Asynchronous: the receiver answers on this process's event loop.
 */
function sendAs(uid: number, path: string, data: string): Promise<{ status: number | null; stderr: string }> {
  const script = `const c = require('net').connect(process.argv[1]); c.on('error', (e) => { console.error(e.code); process.exit(3); }); const a = process.argv[2]; c.end(a.startsWith('#') ? 'x'.repeat(Number(a.slice(1))) : a);`;
  const p = spawn('setpriv', [`--reuid=${uid}`, `--regid=${uid}`, '--clear-groups', process.execPath, '-e', script, path, data], { stdio: ['ignore', 'ignore', 'pipe'], timeout: 20_000 });
  let stderr = '';
  p.stderr.on('data', (d: Buffer) => (stderr += d.toString()));
  return new Promise((resolve) => p.once('close', (status) => resolve({ status, stderr })));
}

describe('snapshot state receiver (the socket a jailed QEMU streams a snapshot into)', () => {
  it('only the VM\'s own id reaches the socket; its stream lands whole in a file QEMU could not open', async () => {
    const stateFile = join(work, 'state.bin');
    const rx = await openStateReceiver(stateFile, VM_UID, 'vm-a', { timeoutMs: 30_000, maxBytes: 64 << 20 });
    const path = rx.uri.replace(/^unix:/, '');
    const dir = dirname(path);
    expect(statSync(dir).uid).toBe(VM_UID);
    expect(statSync(dir).mode & 0o777).toBe(0o700);
    // Another VM's QEMU (another id) cannot even reach the socket.
    const other = await sendAs(OTHER_UID, path, 'forged state');
    expect(other.status).toBe(3);
    expect(other.stderr).toMatch(/EACCES/);
    const payload = 'x'.repeat(1 << 20);
    expect((await sendAs(VM_UID, path, `#${payload.length}`)).status).toBe(0);
    expect(await rx.done).toBe(payload.length);
    rx.close();
    expect(readFileSync(stateFile, 'utf8')).toBe(payload);
    expect(statSync(stateFile).uid).toBe(0);
    expect(existsSync(dir)).toBe(false);
  });

  it('takes one stream only: a second connection finds nobody listening', async () => {
    const rx = await openStateReceiver(join(work, 'one.bin'), VM_UID, 'vm-b', { timeoutMs: 30_000, maxBytes: 64 << 20 });
    const path = rx.uri.replace(/^unix:/, '');
    expect((await sendAs(VM_UID, path, 'first')).status).toBe(0);
    await rx.done;
    const second = await sendAs(VM_UID, path, 'second');
    expect(second.status).toBe(3);
    rx.close();
    expect(readFileSync(join(work, 'one.bin'), 'utf8')).toBe('first');
  });

  it('refuses, naming the directory, a temp dir the VM\'s id could not reach', async () => {
    const closed = mkdtempSync(join(work, 'closed-'));
    chmodSync(closed, 0o700);
    const saved = process.env['TMPDIR'];
    process.env['TMPDIR'] = join(closed, 'tmp');
    mkdirSync(process.env['TMPDIR'], { mode: 0o1777 });
    try {
      await expect(openStateReceiver(join(work, 'x.bin'), VM_UID, 'vm-d', { timeoutMs: 1000, maxBytes: 64 << 20 })).rejects.toThrow(new RegExp(`cannot search ${closed}`));
    } finally {
      if (saved === undefined) delete process.env['TMPDIR'];
      else process.env['TMPDIR'] = saved;
    }
  });

  it('gives up with a typed timeout when no stream comes, and leaves no directory behind', async () => {
    const rx = await openStateReceiver(join(work, 'never.bin'), VM_UID, 'vm-c', { timeoutMs: 300, maxBytes: 64 << 20 });
    const dir = dirname(rx.uri.replace(/^unix:/, ''));
    const err = await rx.done.catch((e: unknown) => e);
    expect(err).toBeInstanceOf(HutchError);
    expect((err as HutchError).code).toBe('timeout');
    expect((err as HutchError).message).toMatch(/vm-c/);
    expect(existsSync(dir)).toBe(false);
    rx.close();
  });

  it('refuses a stream longer than the VM could hold (a QEMU that is no longer ours filling the disk): typed, the partial file gone', async () => {
    const stateFile = join(work, 'endless.bin');
    const rx = await openStateReceiver(stateFile, VM_UID, 'vm-e', { timeoutMs: 30_000, maxBytes: 1 << 20 });
    const path = rx.uri.replace(/^unix:/, '');
    const sender = sendAs(VM_UID, path, `#${8 << 20}`);
    await expect(rx.done).rejects.toMatchObject({ code: 'too_large', message: expect.stringContaining('passed 1048576 bytes') });
    rx.close();
    await sender; // cut off (EPIPE or reset) or done: either way it ends
    expect(existsSync(stateFile)).toBe(false);
  });
});
