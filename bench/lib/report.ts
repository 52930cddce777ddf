import { mkdirSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
/**
 * Shared output conventions of every bench: a Markdown table for people, and with --json
 * one JSON object as the very last line for machines.
 */
export interface BenchArgs {
  json: boolean;
  argv: string[];
}

export function benchArgs(): BenchArgs {
  const argv = process.argv.slice(2);
  return { json: argv.includes('--json'), argv };
}

export function percentile(values: number[], p: number): number {
  if (values.length === 0) return NaN;
  const s = [...values].sort((a, b) => a - b);
  const idx = Math.min(s.length - 1, Math.max(0, Math.ceil((p / 100) * s.length) - 1));
  return s[idx] as number;
}

export function median(values: number[]): number {
  return percentile(values, 50);
}

export function round(n: number, digits = 2): number {
  const f = 10 ** digits;
  return Math.round(n * f) / f;
}

export function markdownTable(rows: Array<Record<string, string | number | boolean | null>>): string {
  if (rows.length === 0) return '';
  const cols = Object.keys(rows[0] as object);
  const line = (cells: string[]) => `| ${cells.join(' | ')} |`;
  return [line(cols), line(cols.map(() => '---')), ...rows.map((r) => line(cols.map((c) => String(r[c] ?? ''))))].join('\n');
}

/**
 * Prints the table, then the raw samples, then (always the last line) the summary JSON,
 * ratios and medians first. writeResults keeps a run in bench/results.
 */
export function emit(title: string, table: string, summary: Record<string, unknown>, raw?: unknown): void {
  process.stdout.write(`## ${title}\n\n${table}\n\n`);
  if (raw !== undefined) process.stdout.write(`raw: ${JSON.stringify(raw)}\n`);
  process.stdout.write(JSON.stringify(summary) + '\n');
}

/** Keeps a run in bench/results: <name>.md (the table), <name>.json (the summary), <name>.raw.json (the samples). */
export function writeResults(name: string, title: string, table: string, summary: Record<string, unknown>, raw: unknown): void {
  const dir = join(dirname(fileURLToPath(import.meta.url)), '..', 'results');
  mkdirSync(dir, { recursive: true });
  writeFileSync(join(dir, `${name}.md`), `## ${title}\n\n${table}\n`);
  writeFileSync(join(dir, `${name}.json`), JSON.stringify({ at: new Date().toISOString(), ...summary }, null, 2) + '\n');
  writeFileSync(join(dir, `${name}.raw.json`), JSON.stringify(raw) + '\n');
}
