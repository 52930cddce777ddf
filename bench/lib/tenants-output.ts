/**
 * What a density run leaves behind: the summary table (one row per level, the published
 * table's shape), the per-step table, an SVG plot of p99 added latency against tenants
 * per level (drawn by hand: a few lines and circles need no plotting library), and the
 * JSON they all come from. Results of several invocations merge by level, so levels run
 * at different times end up in one table and one plot.
 */
import { existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { markdownTable } from './report.ts';
import type { LevelResult } from './tenants-search.ts';
import { PASS_P99_MS, type StepResult } from './tenants-step.ts';

export interface RunInfo {
  accel: string;
  host: string;
  started: string;
  command: string;
  time_compression: number;
  step_duration_s: number;
  seed: number;
  sessions: number;
  sessions_total: number;
  sessions_dir: string;
  bare_reps: number;
  excluded_sessions: Array<{ session: string; reason: string }>;
  memory_note: string;
  cpu_note: string;
  notes: string[];
}

export interface Results {
  runs: Record<string, RunInfo>;
  levels: LevelResult[];
}

/** The step a level's row reports: its largest passing N, else its smallest N. */
export function headline(l: LevelResult): StepResult | undefined {
  const passed = l.steps.filter((s) => s.pass && s.tenants === l.max_tenants);
  if (passed.length) return passed[passed.length - 1];
  return [...l.steps].sort((a, b) => a.tenants - b.tenants)[0];
}

/** Host memory per tenant at the largest N that passed the broker-added rule (else the smallest N run). */
function perTenantMiB(l: LevelResult): number | string {
  const byN = [...l.steps].sort((a, b) => b.tenants - a.tenants);
  const st = byN.find((s) => s.pass_broker_rule) ?? byN[byN.length - 1];
  return st?.host_mib_per_tenant ?? (st ? Math.round((st.peak_host_mib / st.tenants) * 10) / 10 : '');
}

export function summaryTable(levels: LevelResult[]): string {
  return markdownTable(
    levels.map((l) => {
      const h = headline(l);
      if (l.unavailable || !h) return { level: l.level, 'max tenants': `unavailable: ${l.unavailable ?? 'no step ran'}`, 'max tenants (broker-added rule)': '', 'MiB per tenant': '', 'at N': '', 'p50 added ms': '', 'p99 added ms': '', calls: '', wakes: '', 'CPU %': '', 'peak host MiB': '', errors: '', accel: '', compression: '' };
      return {
        level: l.level,
        'max tenants': l.max_tenants,
        'max tenants (broker-added rule)': l.max_tenants_broker_rule ?? 'not run',
        'MiB per tenant': perTenantMiB(l),
        'at N': h.tenants,
        'p50 added ms': h.p50_added_ms,
        'p99 added ms': h.p99_added_ms,
        calls: h.calls,
        wakes: h.wakes,
        'CPU %': h.cpu_tree_pct,
        'peak host MiB': h.peak_host_mib,
        errors: h.errors,
        accel: h.accel,
        compression: h.time_compression,
      };
    }),
  );
}

export function stepsTable(levels: LevelResult[]): string {
  return markdownTable(
    levels.flatMap((l) =>
      [...l.steps]
        .sort((a, b) => a.tenants - b.tenants)
        .map((s) => ({
          level: l.level,
          N: s.tenants,
          pass: s.pass ? 'yes' : 'no',
          'pass (broker-added)': s.pass_broker_rule === undefined ? '' : s.pass_broker_rule ? 'yes' : 'no',
          'p50 / p90 / p99 added ms': `${s.p50_added_ms} / ${s.p90_added_ms} / ${s.p99_added_ms}`,
          'p99 broker-added ms': s.p99_broker_added_ms,
          'p99 by route ms': Object.entries(s.p99_added_ms_by_route).map(([r, v]) => `${r} ${v}`).join(', '),
          calls: s.calls,
          wakes: s.wakes,
          'CPU % (tree / host), load': `${s.cpu_tree_pct} / ${s.cpu_host_pct}, ${s.load1}`,
          'host MiB / QEMU PSS MiB': `${s.peak_host_mib} / ${s.peak_qemu_pss_mib}`,
          'live VMs': s.peak_live_vms,
          errors: s.errors,
          why: s.fail_reasons.join('; '),
        })),
    ),
  );
}

/** Fixed per level, so a level keeps its colour whichever levels a plot holds. */
const COLORS: Record<string, string> = { '1': '#8c564b', '2': '#ff7f0e', '3': '#2ca02c', '4': '#1f77b4', reclaim: '#9467bd', prefetch: '#e377c2' };

function esc(s: string): string {
  return s.replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;');
}

/** p99 added latency (log y) against tenants (log2 x), one line per level; filled = passed. */
export function plotSvg(levels: LevelResult[], subtitle: string): string {
  const W = 760;
  const H = 460;
  const m = { l: 70, r: 150, t: 50, b: 55 };
  const steps = levels.flatMap((l) => l.steps);
  const ns = steps.map((s) => s.tenants);
  const ys = steps.map((s) => Math.max(1, s.p99_added_ms)).filter(Number.isFinite);
  const xMax = Math.max(2, 2 ** Math.ceil(Math.log2(Math.max(2, ...ns))));
  const yMin = 10 ** Math.floor(Math.log10(Math.min(PASS_P99_MS / 3, ...ys)));
  const yMax = 10 ** Math.ceil(Math.log10(Math.max(PASS_P99_MS * 3, ...ys)));
  // Half an octave of margin on both sides keeps N=1 and N=max off the frame.
  const x = (n: number) => m.l + ((Math.log2(n) + 0.5) / (Math.log2(xMax) + 1)) * (W - m.l - m.r);
  const y = (v: number) => H - m.b - ((Math.log10(Math.max(v, yMin)) - Math.log10(yMin)) / (Math.log10(yMax) - Math.log10(yMin))) * (H - m.t - m.b);
  const out: string[] = [];
  out.push(`<svg xmlns="http://www.w3.org/2000/svg" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}" font-family="sans-serif" font-size="12">`);
  out.push(`<rect width="${W}" height="${H}" fill="white"/>`);
  out.push(`<text x="${m.l}" y="20" font-size="15" font-weight="bold">p99 added latency vs tenants, per level</text>`);
  out.push(`<text x="${m.l}" y="37" fill="#555">${esc(subtitle)}</text>`);
  for (let n = 1; n <= xMax; n *= 2) {
    out.push(`<line x1="${x(n)}" y1="${m.t}" x2="${x(n)}" y2="${H - m.b}" stroke="#eee"/>`);
    out.push(`<text x="${x(n)}" y="${H - m.b + 16}" text-anchor="middle">${n}</text>`);
  }
  for (let d = yMin; d <= yMax; d *= 10) {
    for (const k of [1, 3]) {
      const v = d * k;
      if (v > yMax) continue;
      out.push(`<line x1="${m.l}" y1="${y(v)}" x2="${W - m.r}" y2="${y(v)}" stroke="#eee"/>`);
      out.push(`<text x="${m.l - 6}" y="${y(v) + 4}" text-anchor="end">${v >= 1000 ? `${v / 1000} s` : `${v} ms`}</text>`);
    }
  }
  out.push(`<rect x="${m.l}" y="${m.t}" width="${W - m.l - m.r}" height="${H - m.t - m.b}" fill="none" stroke="#888"/>`);
  out.push(`<line x1="${m.l}" y1="${y(PASS_P99_MS)}" x2="${W - m.r}" y2="${y(PASS_P99_MS)}" stroke="#d62728" stroke-dasharray="6 4"/>`);
  out.push(`<text x="${W - m.r - 4}" y="${y(PASS_P99_MS) - 5}" text-anchor="end" fill="#d62728">pass: p99 &lt; 1.5 s</text>`);
  out.push(`<text x="${(m.l + W - m.r) / 2}" y="${H - 15}" text-anchor="middle">tenants (log2)</text>`);
  out.push(`<text transform="translate(18 ${(m.t + H - m.b) / 2}) rotate(-90)" text-anchor="middle">p99 added latency (log)</text>`);
  levels.forEach((l, i) => {
    const color = COLORS[l.level] ?? '#333';
    const pts = [...l.steps].sort((a, b) => a.tenants - b.tenants).filter((s) => Number.isFinite(s.p99_added_ms));
    if (pts.length > 1) out.push(`<polyline fill="none" stroke="${color}" stroke-width="2" points="${pts.map((s) => `${x(s.tenants).toFixed(1)},${y(s.p99_added_ms).toFixed(1)}`).join(' ')}"/>`);
    for (const s of pts) {
      out.push(`<circle cx="${x(s.tenants).toFixed(1)}" cy="${y(s.p99_added_ms).toFixed(1)}" r="4.5" stroke="${color}" stroke-width="2" fill="${s.pass ? color : 'white'}"><title>level ${esc(l.level)}, N=${s.tenants}: p99 ${s.p99_added_ms} ms, ${s.calls} calls, ${s.pass ? 'pass' : esc(s.fail_reasons.join('; '))}</title></circle>`);
    }
    const ly = m.t + 14 + i * 20;
    const label = l.unavailable ? `level ${l.level}: unavailable` : `level ${l.level}: max ${l.max_tenants} / ${l.max_tenants_broker_rule ?? '-'} broker rule`;
    out.push(`<line x1="${W - m.r + 12}" y1="${ly - 4}" x2="${W - m.r + 32}" y2="${ly - 4}" stroke="${color}" stroke-width="2"/>`);
    out.push(`<text x="${W - m.r + 38}" y="${ly}">${esc(label)}</text>`);
  });
  const ly = m.t + 14 + levels.length * 20 + 10;
  out.push(`<circle cx="${W - m.r + 22}" cy="${ly - 4}" r="4.5" fill="#444"/><text x="${W - m.r + 38}" y="${ly}">passed</text>`);
  out.push(`<circle cx="${W - m.r + 22}" cy="${ly + 16}" r="4.5" fill="white" stroke="#444" stroke-width="2"/><text x="${W - m.r + 38}" y="${ly + 20}">failed</text>`);
  out.push('</svg>');
  return out.join('\n') + '\n';
}

/** Merges this run's levels into what `dir` already holds (a level run again replaces its old result). */
export function mergeResults(dir: string, runId: string, run: RunInfo, levels: LevelResult[]): Results {
  const file = join(dir, 'tenants.json');
  const old: Results = existsSync(file) ? (JSON.parse(readFileSync(file, 'utf8')) as Results) : { runs: {}, levels: [] };
  const kept = old.levels.filter((l) => !levels.some((n) => n.level === l.level));
  const merged: Results = { runs: { ...old.runs, [runId]: run }, levels: [...kept, ...levels.map((l) => ({ ...l, run: runId }))] };
  // Runs no level points at any more are dropped.
  const used = new Set(merged.levels.map((l) => (l as LevelResult & { run?: string }).run));
  merged.runs = Object.fromEntries(Object.entries(merged.runs).filter(([id]) => used.has(id)));
  const order = ['1', '2', '3', '4', 'reclaim', 'prefetch'];
  merged.levels.sort((a, b) => order.indexOf(a.level) - order.indexOf(b.level));
  return merged;
}

/** Writes the JSON, table and plot; the raw per-call samples too when given (a re-render keeps the old ones). */
export function writeResults(dir: string, results: Results, raw?: unknown): void {
  mkdirSync(dir, { recursive: true });
  const runs = Object.values(results.runs);
  const accel = [...new Set(runs.map((r) => r.accel))].join(', ');
  const compression = [...new Set(runs.map((r) => r.time_compression))].join(', ');
  const subtitle = `accel ${accel}; time compression ${compression}; ${runs[0]?.host ?? ''}`;
  writeFileSync(join(dir, 'tenants.json'), JSON.stringify(results, null, 2) + '\n');
  writeFileSync(join(dir, 'tenants.svg'), plotSvg(results.levels, subtitle));
  if (raw !== undefined) writeFileSync(join(dir, 'tenants.raw.json'), JSON.stringify(raw) + '\n');
  const md = [
    '# Density: tenants per level (bench/tenants.ts)',
    '',
    `Accelerator: **${accel}**. Time compression: **${compression}** (1 = recorded think times and 2-minute mean away times as they are).`,
    '',
    summaryTable(results.levels),
    '',
    'A row reports the step at its level\'s largest passing N; where no N passed, its smallest N. Pass at N (published rule): p99 added latency over the bare host < 1.5 s, no errors, no OOM kill. Broker-added rule: the same with the p99 of the broker\'s own added time (queueing, wakes, workspace sync; the command\'s run time left out) in place of the added latency; the search is driven by the rule named in the run\'s command (`--rule`, default broker) and both maxima are reported. MiB per tenant: host memory (MemTotal - MemAvailable above the step\'s baseline, at its peak) over N, at the largest N passing the broker-added rule.',
    '',
    ...(runs.some((r) => r.accel === 'tcg')
      ? [
          'Reading these under TCG: added latency is measured against the same command run bare on the host, so it includes how much slower the guest runs it under software emulation (Python and Node start 10-30x slower than on the host; a `salesreport` run of ~1.2 s bare takes tens of seconds). Any call routed to a VM then adds seconds even with one tenant, and no level can meet the 1.5 s rule on this machine; the curve (how fast p99 grows with N) and the broker-added column (hutch\'s own time: queueing, wakes, workspace sync; the guest\'s run time left out) are what compare levels here. On a host with working KVM the same run gives the published kind of figure.',
          '',
        ]
      : []),
    'CPU % is the bench\'s own process tree; host % counts everything on the host. Where host % is far above it, or the load column is high, other work shared the host during that step and the latencies are pessimistic.',
    '',
    '![p99 added latency vs tenants](tenants.svg)',
    '',
    '## Every step',
    '',
    stepsTable(results.levels),
    '',
    ...results.levels.flatMap((l) => [`- level ${l.level}: ${l.unavailable ? `unavailable: ${l.unavailable}` : l.stopped}`]),
    '',
    ...results.levels.flatMap((l) => l.steps.filter((s) => s.errors > 0).map((s) => `- errors at level ${l.level}, N=${s.tenants}: ${s.error_samples.join('; ')}`)),
    '',
    '## How these were measured',
    '',
    ...Object.entries(results.runs).flatMap(([id, r]) => [
      `### run ${id}`,
      '',
      `- command: \`${r.command}\``,
      `- started ${r.started} on ${r.host}; seed ${r.seed}; ${r.sessions} of ${r.sessions_total} sessions from ${r.sessions_dir}; bare baseline: median of ${r.bare_reps} bare replay(s) per call`,
      `- each step: a fresh broker, N tenants for ${r.step_duration_s} s of wall time (calls in flight at the end finish; no new call starts)`,
      `- memory: ${r.memory_note}`,
      `- CPU: ${r.cpu_note}`,
      ...(r.excluded_sessions.length ? [`- sessions left out (bare replay failed): ${r.excluded_sessions.map((e) => `${e.session}: ${e.reason}`).join('; ')}`] : []),
      ...r.notes.map((n) => `- ${n}`),
      '',
    ]),
  ];
  writeFileSync(join(dir, 'tenants.md'), md.join('\n'));
}
