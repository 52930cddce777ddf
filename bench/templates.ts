/**
 * Restore time per template: for the default template and every template in the data dir,
 * N fresh sandboxes started from the template's pristine snapshot (QEMU restore to a
 * usable agent with the workspace pushed), one at a time. Timings move with the host's load.
 *
 *   npx tsx bench/templates.ts [--data-dir D] [--runs N] [--json] [--quick]
 * Last line: one JSON object { templates: { name: { snapshotBytes, restoreMs: [...], wakeMs: [...] } } }.
 */
import { mkdirSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { createLogger } from '../guest-agent/src/log.ts';
import { QemuBackend } from '../host-broker/src/backends/qemu-backend.ts';
import { cacheDir } from '../host-broker/src/backends/registry.ts';
import { defaultDataDir, TemplateStore } from '../host-broker/src/templates/store.ts';

const { values } = parseArgs({ options: { 'data-dir': { type: 'string' }, runs: { type: 'string' }, json: { type: 'boolean', default: false }, quick: { type: 'boolean', default: false } } });
const dataDir = defaultDataDir(values['data-dir']);
/** --quick: one sandbox of the default template only, to check the bench reaches its JSON line (test/benches.test.ts, VM tier). */
const runs = Number(values.runs ?? (values.quick ? 1 : 3));
const log = createLogger({ name: 'bench-templates', level: 'warn' });
const backend = await QemuBackend.create({ dataDir, cacheDir: cacheDir(), log });
const names = ['default', ...(values.quick ? [] : new TemplateStore(dataDir).list().map((e) => e.name))];
const work = mkdtempSync(join(tmpdir(), 'hutch-bench-templates-'));
const out: Record<string, { snapshotBytes: number; restoreMs: number[]; wakeMs: number[] }> = {};
try {
  for (const name of names) {
    const r = { snapshotBytes: 0, restoreMs: [] as number[], wakeMs: [] as number[] };
    for (let i = 0; i < runs; i++) {
      const dir = join(work, `${name}-${i}`);
      mkdirSync(join(dir, 'ws'), { recursive: true });
      mkdirSync(join(dir, 'st'), { recursive: true });
      const spec = { session: `bench-${name}-${i}`.slice(0, 40), workspaceDir: join(dir, 'ws'), stateDir: join(dir, 'st'), cpus: 1, memoryMiB: 512, ...(name === 'default' ? {} : { template: name }) };
      if (i === 0) {
        // Built (or found) before the first timed restore.
        const t = backend.template(spec.template);
        const p = await t.snapshots.pristine(t.image, { memoryMiB: 512, cpus: 1, swapMiB: 512 });
        r.snapshotBytes = TemplateStore.allocatedBytes(p.dir);
      }
      const { sandbox, wake } = await backend.start(spec);
      r.restoreMs.push(Math.round(wake.restoreMs ?? -1));
      r.wakeMs.push(Math.round(wake.wakeMs));
      const r0 = await sandbox.exec({ command: 'python3 -c 1 || true; exit 7' }, { kind: 'none' });
      if (r0.exitCode !== 7) throw new Error(`${name}: a command in the restored VM exited ${r0.exitCode}, not 7`);
      await sandbox.close();
    }
    out[name] = r;
    if (!values.json) console.log(`${name}: pristine snapshot ${(r.snapshotBytes / 2 ** 20).toFixed(0)} MiB on disk; restore ms ${r.restoreMs.join(', ')}; wake ms ${r.wakeMs.join(', ')}`);
  }
} finally {
  await backend.shutdown();
  rmSync(work, { recursive: true, force: true });
}
console.log(JSON.stringify({ dataDir, runs, load: (await import('node:os')).loadavg()[0], templates: out }));
