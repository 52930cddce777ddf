import { mkdirSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { Workspace } from '../../../guest-agent/src/workspace/confine.ts';
import type { AgentClient } from '../agent-client.ts';
import { WorkspaceMirror } from '../sync/workspace-mirror.ts';
import { resumeGuest } from './agent-channel.ts';

/**
 * A wake's work in a just-restored guest, done once ahead of any tenant: under TCG every
 * guest code path runs translated for the first time in each QEMU process (a cold push of
 * a small project costs 3-5x a warm one), so a standby VM runs the paths a wake and a
 * first call take (resume, a fresh push with its marker, a fork and exec as the tenant
 * user, a pull, deletes) on a throwaway project, then empties /work again. Nothing of a
 * tenant is involved, and the guest must end as clean as it began (checked).
 */
export async function warmStandby(agent: AgentClient, dir: string, timeoutMs: number): Promise<{ ms: number }> {
  const t0 = performance.now();
  rmSync(dir, { recursive: true, force: true });
  const root = join(dir, 'workspace');
  writeProject(root);
  try {
    const ws = new Workspace(root);
    const mirror = new WorkspaceMirror(ws, undefined, { stateDir: join(dir, 'state') });
    await resumeGuest(agent);
    const pushed = await mirror.push(agent, undefined, { fresh: true, mark: true });
    const marker = pushed.marker?.marker ?? (await agent.call('sync.mark', {})).marker;
    const r = await agent.run({ command: 'cat src/*.py >/dev/null && ls -la . src >/dev/null && grep -rl def src >/dev/null && echo ok > warm.out', timeoutMs });
    if (r.exitCode !== 0) throw new HutchError('internal', `standby warm-up command exited ${r.exitCode}: ${r.stderrText.slice(0, 200)}`);
    await mirror.pull(agent, marker, 1024 * 1024);
    // Empty /work again: the session's fresh push then records what lands instead of scanning.
    rmSync(root, { recursive: true, force: true });
    mkdirSync(root);
    await mirror.push(agent);
    const st = await agent.call('agent.state', { maxPaths: 10 });
    if (st.dirty || st.processes > 0) {
      throw new HutchError('internal', `standby warm-up left state in the guest (dirty: ${st.dirtyPaths.join(', ') || 'none'}; processes: ${st.processes}); the VM is not used`);
    }
    const left = await agent.call('sync.mark', {});
    if (left.entries !== 0) throw new HutchError('internal', `standby warm-up left ${left.entries} entries in /work; the VM is not used`);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
  return { ms: performance.now() - t0 };
}

/** A small project like the ones agents work on: sources in a few directories, one larger file, a symlink, a script. */
function writeProject(root: string): void {
  for (const d of ['src', 'src/pkg', 'tests', 'docs']) mkdirSync(join(root, d), { recursive: true });
  for (let i = 0; i < 12; i++) writeFileSync(join(root, 'src', `mod${i}.py`), `def f${i}(x):\n    return x * ${i}\n`.repeat(20));
  for (let i = 0; i < 8; i++) writeFileSync(join(root, 'src/pkg', `part${i}.py`), `VALUE_${i} = ${i}\n`);
  for (let i = 0; i < 8; i++) writeFileSync(join(root, 'tests', `test_${i}.py`), `def test_${i}():\n    assert True\n`);
  writeFileSync(join(root, 'docs', 'notes.md'), '# notes\n'.repeat(2000));
  writeFileSync(join(root, 'data.bin'), Buffer.alloc(300 * 1024, 7));
  writeFileSync(join(root, 'run.sh'), '#!/bin/sh\necho run\n', { mode: 0o755 });
  symlinkSync('src/mod0.py', join(root, 'main.py'));
}
