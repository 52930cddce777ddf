/**
 * The broker bench/soak.ts runs and kills: the real broker (`serve`, qemu backend) in its own
 * process, plus a control socket only the bench reaches, for faults that need the inside
 * (killing a guest's agent process). Settings come as one JSON argument; the first stdout
 * line is `{"port":N}` once the broker listens.
 */
import { createServer } from 'node:net';
import { rmSync } from 'node:fs';
import { createLogger } from '../../guest-agent/src/log.ts';
import { policyFromFlags, serve } from '../../host-broker/src/cli.ts';

interface Settings {
  dataDir: string;
  token: string;
  idleMs: number;
  control: string;
}

const s = JSON.parse(process.argv[2] ?? '{}') as Settings;
const log = createLogger({ name: 'soak-broker', level: (process.env['HUTCH_LOG_LEVEL'] as 'warn' | undefined) ?? 'warn' });
const broker = await serve({ port: 0, host: '127.0.0.1', token: s.token, dataDir: s.dataDir, backend: 'qemu', policy: policyFromFlags('4', String(s.idleMs), undefined), log });

rmSync(s.control, { force: true });
const control = createServer((sock) => {
  let buf = '';
  sock.on('data', (d) => {
    buf += d.toString();
    const nl = buf.indexOf('\n');
    if (nl < 0) return;
    const cmd = JSON.parse(buf.slice(0, nl)) as { cmd: 'agent-exit'; session: string };
    void (async () => {
      try {
        const sb = broker.sessions.get(cmd.session).vm.liveSandbox();
        if (!sb) return sock.end(JSON.stringify({ ok: false, why: 'no live VM' }) + '\n');
        // The agent dies as a crash would; tini follows and the guest stops.
        await sb.agent.call('debug.exit', {}).catch(() => undefined);
        sock.end(JSON.stringify({ ok: true }) + '\n');
      } catch (err) {
        sock.end(JSON.stringify({ ok: false, why: (err as Error).message }) + '\n');
      }
    })();
  });
  sock.on('error', () => undefined);
});
await new Promise<void>((r) => control.listen(s.control, () => r()));
process.stdout.write(JSON.stringify({ port: broker.port }) + '\n');

const stop = async () => {
  control.close();
  await broker.stop();
  process.exit(0);
};
process.once('SIGTERM', () => void stop());
process.once('SIGINT', () => void stop());
