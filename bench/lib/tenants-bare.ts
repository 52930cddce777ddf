/**
 * The baseline of "added latency": every session replayed bare on the host (file tools in
 * process, bash with `bash -c`), before any tenant runs, its per-call times kept for the
 * run. A session whose bare replay does not succeed cannot serve as a baseline and is
 * left out of the tenants' pool, with the reason reported.
 */
import { rmSync } from 'node:fs';
import { join } from 'node:path';
import { median } from './report.ts';
import { prepareWorkspace, replayBare, type RecordedSession } from './sessions.ts';

export interface BareBaseline {
  /** Median bare time per call, by session id, in call order. */
  ms: Map<string, number[]>;
  /** Sessions left out, with why. */
  excluded: Array<{ session: string; reason: string }>;
  reps: number;
  totalMs: number;
}

export async function measureBare(sessions: RecordedSession[], projectDirs: string[], workDir: string, reps: number, progress: (m: string) => void): Promise<BareBaseline> {
  const ms = new Map<string, number[]>();
  const excluded: BareBaseline['excluded'] = [];
  const t0 = performance.now();
  for (const s of sessions) {
    const runs: number[][] = [];
    let failure: string | undefined;
    for (let r = 0; r < reps && !failure; r++) {
      const dir = join(workDir, `bare-${s.id}-${r}`);
      try {
        prepareWorkspace(s.project, join(dir, 'work'), projectDirs);
        const out = await replayBare(s, join(dir, 'work'), join(dir, 'home'));
        const bad = out.findIndex((o) => !o.ok);
        if (bad >= 0) failure = `bare replay call ${bad + 1} (${out[bad]?.tool}) failed: ${out[bad]?.error ?? `exit ${out[bad]?.exitCode}, expected ${s.calls[bad]?.expect?.exit_code ?? 0}`}`;
        else runs.push(out.map((o) => o.ms));
      } catch (err) {
        failure = `bare replay could not run: ${(err as Error).message}`;
      } finally {
        rmSync(dir, { recursive: true, force: true });
      }
    }
    if (failure) {
      excluded.push({ session: s.id, reason: failure });
      progress(`bare: ${s.id} left out: ${failure}`);
      continue;
    }
    ms.set(
      s.id,
      s.calls.map((_, i) => median(runs.map((run) => run[i] as number))),
    );
  }
  return { ms, excluded, reps, totalMs: performance.now() - t0 };
}
