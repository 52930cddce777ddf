import { describe, expect, it } from 'vitest';
import { createServer, type Server } from 'node:net';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { QmpClient } from '../host-broker/src/vm/qmp.ts';

// A stand-in for QEMU's monitor socket (named so): it reproduces the two ways a real
// monitor has been seen to leave a client waiting, which a healthy QEMU cannot be made to do
// on demand: accepting and closing without a greeting, and accepting and saying nothing.
async function fakeMonitor(onConn: (s: import('node:net').Socket) => void): Promise<{ path: string; server: Server; dir: string }> {
  const dir = mkdtempSync(join(tmpdir(), 'hutch-qmp-'));
  const path = join(dir, 'qmp.sock');
  const server = createServer(onConn);
  await new Promise<void>((r) => server.listen(path, r));
  return { path, server, dir };
}

describe('QMP client', () => {
  it('fails a connect whose socket closes before the greeting (used to hang forever)', async () => {
    const m = await fakeMonitor((s) => s.destroy());
    try {
      await expect(QmpClient.connect(m.path, 5_000)).rejects.toMatchObject({ code: 'unavailable' });
    } finally {
      m.server.close();
      rmSync(m.dir, { recursive: true, force: true });
    }
  });

  it('fails a connect that never gets a greeting within its deadline', async () => {
    const held: import('node:net').Socket[] = [];
    const m = await fakeMonitor((s) => void held.push(s));
    try {
      await expect(QmpClient.connect(m.path, 300)).rejects.toMatchObject({ code: 'timeout' });
    } finally {
      for (const s of held) s.destroy();
      m.server.close();
      rmSync(m.dir, { recursive: true, force: true });
    }
  });

  it('ends an event wait when the monitor goes away instead of waiting out its timeout', async () => {
    let conn: import('node:net').Socket | undefined;
    const m = await fakeMonitor((s) => {
      conn = s;
      s.write('{"QMP": {"version": {}, "capabilities": []}}\n');
      s.on('data', () => s.write('{"return": {}}\n'));
    });
    try {
      const c = await QmpClient.connect(m.path, 5_000);
      const wait = c.waitEvent('MIGRATION', () => true, 600_000);
      conn!.destroy();
      await expect(wait).rejects.toMatchObject({ code: 'guest_crashed' });
    } finally {
      m.server.close();
      rmSync(m.dir, { recursive: true, force: true });
    }
  });

  it('a monitor that writes without end (a QEMU a guest escaped into) fails the waiting command as soon as a message passes 1 MiB', async () => {
    let conn: import('node:net').Socket | undefined;
    let sent = 0;
    const m = await fakeMonitor((s) => {
      conn = s;
      s.write('{"QMP": {"version": {}, "capabilities": []}}\n');
      s.once('data', () => {
        s.write('{"return": {}}\n');
        // The answer to the next command never ends.
        s.once('data', () => {
          const chunk = Buffer.alloc(64 * 1024, 0x20);
          const pump = () => {
            while (!s.destroyed && sent < 64 * 1024 * 1024) {
              sent += chunk.length;
              if (!s.write(chunk)) return void s.once('drain', pump);
            }
          };
          s.on('error', () => undefined);
          pump();
        });
      });
    });
    try {
      const c = await QmpClient.connect(m.path, 5_000);
      await expect(c.execute('query-status')).rejects.toMatchObject({ code: 'guest_crashed', message: expect.stringContaining('over 1048576 bytes') });
      // The client stopped reading at the limit, not at the writer's 64 MiB.
      expect(sent).toBeLessThan(16 * 1024 * 1024);
      await expect(c.execute('query-status')).rejects.toMatchObject({ code: 'guest_crashed' });
    } finally {
      conn?.destroy();
      m.server.close();
      rmSync(m.dir, { recursive: true, force: true });
    }
  });
});
