/**
 * A reporter that makes skips loud: after the run it prints how many tests were skipped
 * and why, grouped by reason, so a green run that left out the microVM tier says so.
 * Reasons come from the `vm` tag (the machine's reason, from tiers.ts) and from the
 * "SKIPPING ..." line a test file logs when it skips itself (describe.skipIf).
 */
import type { UserConsoleLog } from 'vitest';
import type { Reporter, TestModule } from 'vitest/node';

export class SkipSummary implements Reporter {
  /** "SKIPPING ...: reason" lines, by the task that logged them (a file logs as its module). */
  private readonly notes: Array<{ taskId: string | undefined; line: string; reason: string }> = [];

  constructor(
    private readonly vmReason: string | undefined,
    private readonly scaleReason?: string | undefined,
  ) {}

  onUserConsoleLog(log: UserConsoleLog): void {
    const line = log.content.trim();
    const m = /^SKIPPING\b.*?:\s*(.*)$/.exec(line);
    if (m?.[1]) this.notes.push({ taskId: log.taskId, line, reason: m[1] });
  }

  onTestRunEnd(modules: ReadonlyArray<TestModule>): void {
    const byReason = new Map<string, { tests: number; files: Set<string> }>();
    for (const mod of modules) {
      const file = mod.relativeModuleId;
      // A file whose setup failed reports its tests as skipped: say so, not "skipped".
      const fileNote = mod.state() === 'failed' ? 'not run: the file failed (its error is above)' : this.notes.find((n) => n.taskId === mod.id || n.line.includes(file))?.reason;
      for (const t of mod.children.allTests()) {
        const r = t.result();
        if (r.state !== 'skipped') continue;
        const reason =
          this.vmReason && t.tags.includes('vm')
            ? `needs a microVM: ${this.vmReason}`
            : this.scaleReason && t.tags.includes('scale')
              ? `a scale test: ${this.scaleReason}`
              : (r.note ?? fileNote ?? 'skipped in the test file (describe.skip / skipIf) or filtered out (-t, .only)');
        const e = byReason.get(reason) ?? { tests: 0, files: new Set<string>() };
        e.tests++;
        e.files.add(file);
        byReason.set(reason, e);
      }
    }
    if (byReason.size === 0) return;
    const total = [...byReason.values()].reduce((n, e) => n + e.tests, 0);
    const lines = [`\nhutch: ${total} test${total === 1 ? '' : 's'} skipped`];
    for (const [reason, e] of byReason) lines.push(`  ${e.tests} skipped: ${reason} (${[...e.files].sort().join(', ')})`);
    process.stdout.write(`${lines.join('\n')}\n`);
  }
}
