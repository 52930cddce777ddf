/**
 * The published density example: N sandboxes at once; each writes a random string to
 * random.txt, reads it back with `cat random.txt`, prints `Sandbox i: <string>`, closes.
 *
 *   npx tsx examples/hundred.ts [N] [--vm]
 *
 * Connects to HUTCH_URL with HUTCH_TOKEN when set; otherwise starts a broker in this
 * process on the embedded defaults. --vm reads the file with python3 instead, which the
 * router must send to the VM.
 */
import { randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Hutch } from 'hutch';
import { createLogger } from '../guest-agent/src/log.ts';
import { serve } from '../host-broker/src/cli.ts';

const n = Number(process.argv.slice(2).find((a) => /^\d+$/.test(a)) ?? 100);
const vm = process.argv.includes('--vm');

let url = process.env['HUTCH_URL'];
let token = process.env['HUTCH_TOKEN'] ?? '';
let stopBroker: (() => Promise<void>) | undefined;
if (!url) {
  const dataDir = mkdtempSync(join(tmpdir(), 'hutch-hundred-'));
  token = randomBytes(16).toString('hex');
  const broker = await serve({ port: 0, host: '127.0.0.1', token, dataDir, log: createLogger({ name: 'hutch-broker', level: 'warn' }) });
  url = `ws://127.0.0.1:${broker.port}`;
  stopBroker = async () => {
    await broker.stop();
    rmSync(dataDir, { recursive: true, force: true });
  };
}

const hutch = await Hutch.connect(url, { token });
const started = Date.now();
let failures = 0;
const routes = new Map<string, number>();
await Promise.all(
  Array.from({ length: n }, async (_, i) => {
    try {
      const sb = await hutch.create({ cpus: 1, memoryMiB: 256 });
      const secret = randomBytes(8).toString('hex');
      await sb.files.write('random.txt', secret);
      const r = await sb.run(vm ? 'python3 -c "print(open(\'random.txt\').read())"' : 'cat random.txt');
      const got = r.stdout.trim();
      routes.set(r.route, (routes.get(r.route) ?? 0) + 1);
      if (r.exitCode !== 0 || got !== secret) {
        failures++;
        process.stderr.write(`Sandbox ${i}: MISMATCH (exit ${r.exitCode}, got ${JSON.stringify(got)}, stderr ${r.stderr.trim()})\n`);
      } else process.stdout.write(`Sandbox ${i}: ${got}\n`);
      await sb.close();
    } catch (err) {
      failures++;
      process.stderr.write(`Sandbox ${i}: ERROR ${(err as Error).message}\n`);
    }
  }),
);
hutch.close();
process.stderr.write(`${n - failures}/${n} sandboxes ok in ${Date.now() - started} ms (backend ${hutch.backend}${hutch.accel ? `, ${hutch.accel}` : ''}; routes ${JSON.stringify(Object.fromEntries(routes))})\n`);
await stopBroker?.();
process.exit(failures === 0 ? 0 : 1);
