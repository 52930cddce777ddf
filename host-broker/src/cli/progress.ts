/**
 * Progress of a long set-up (`hutch setup`, `prepare`, the demo's first run) for a person at
 * a terminal: one line that updates in place with the step, what it is doing (the kernel
 * compile's percentage when it reports one) and the time it has taken; a line per finished
 * step; warnings as they come; one summary line at the end. Anywhere else (a pipe, a CI
 * log, `--log-format json`) the same events are the usual JSON log lines.
 */
import { createLogger, type LogFields, type Logger, type LogLevel } from '../../../guest-agent/src/log.ts';
import { stylesFor, type Styles } from './terminal.ts';

export type LogFormat = 'human' | 'json';

/** Human on a terminal, JSON elsewhere. */
export function defaultLogFormat(stream: { isTTY?: boolean } = process.stderr): LogFormat {
  return stream.isTTY ? 'human' : 'json';
}

/** Log names shown as words while a step runs (the rest are shown by name). */
const DOING: Record<string, string> = {
  'snapshot.pristine_build': 'booting a VM to take the pristine snapshot',
  'snapshot.pristine_ready': 'pristine snapshot written',
  'accel.probe': 'probing KVM',
  'backend.qemu': 'guest image ready',
};

const SPINNER = ['|', '/', '-', '\\'];
const ORDER: Record<LogLevel, number> = { debug: 10, info: 20, warn: 30, error: 40 };

export interface ProgressStream {
  write(s: string): unknown;
  isTTY?: boolean;
  columns?: number;
}

export class SetupProgress {
  readonly log: Logger;
  private readonly human: boolean;
  private readonly styles: Styles;
  private readonly started = Date.now();
  private step: { title: string; at: number; part?: string; partAt: number; doing: string } | undefined;
  private spin = 0;
  private timer: NodeJS.Timeout | undefined;

  constructor(private readonly opts: { format: LogFormat; level: LogLevel; name: string; stream?: ProgressStream }) {
    const stream = opts.stream ?? process.stderr;
    this.human = opts.format === 'human';
    this.styles = stylesFor(stream);
    this.log = this.human ? createLogger({ name: opts.name, level: opts.level, write: (line) => this.onLine(line) }) : createLogger({ name: opts.name, level: opts.level, ...(opts.stream ? { write: (l: string) => void opts.stream?.write(`${l}\n`) } : {}) });
  }

  private get out(): ProgressStream {
    return this.opts.stream ?? process.stderr;
  }

  /** Runs one step; its log lines become the status line (human) or are logged as they are (JSON). */
  async run<T>(title: string, fn: () => Promise<T>, result?: (v: T) => string): Promise<T> {
    const at = Date.now();
    if (!this.human) this.log.info('setup.step', { step: title });
    else {
      this.step = { title, at, partAt: at, doing: '' };
      this.timer = setInterval(() => this.draw(), 250);
      this.draw();
    }
    try {
      const v = await fn();
      this.finish(title, at, 'done', result?.(v));
      return v;
    } catch (err) {
      this.finish(title, at, 'failed');
      throw err;
    }
  }

  /** The last line: how long it all took and what it did. */
  summary(text: string, fields: LogFields = {}): void {
    if (this.human) this.out.write(`${this.styles.bold('hutch:')} ${text} (${seconds(Date.now() - this.started)})\n`);
    else this.log.info('setup.ready', { seconds: Math.round((Date.now() - this.started) / 100) / 10, ...fields });
  }

  private finish(title: string, at: number, how: 'done' | 'failed', note?: string): void {
    if (!this.human) {
      this.log[how === 'done' ? 'info' : 'error'](`setup.step_${how}`, { step: title, seconds: Math.round((Date.now() - at) / 100) / 10, ...(note ? { note } : {}) });
      return;
    }
    if (this.timer) clearInterval(this.timer);
    this.timer = undefined;
    this.closePart();
    this.clearLine();
    const mark = how === 'done' ? this.styles.green('ok') : this.styles.red('FAILED');
    this.out.write(`  ${mark} ${title}${note ? ` ${this.styles.dim(`(${note})`)}` : ''} ${this.styles.dim(seconds(Date.now() - at))}\n`);
    this.step = undefined;
  }

  /** A JSON log line from the builders and the backend, shown for a person. */
  private onLine(line: string): void {
    let e: LogFields & { level: LogLevel; msg: string };
    try {
      e = JSON.parse(line) as typeof e;
    } catch {
      return;
    }
    if (ORDER[e.level] >= ORDER.warn) {
      this.clearLine();
      const text = typeof e['text'] === 'string' ? e['text'] : `${e.msg} ${JSON.stringify(strip(e))}`;
      this.out.write(`${e.level === 'error' ? this.styles.red('error:') : this.styles.yellow('warning:')} ${text}\n`);
      this.draw();
      return;
    }
    if (!this.step) return;
    const part = typeof e['part'] === 'string' ? e['part'] : undefined;
    if (part && part !== this.step.part) {
      this.closePart();
      this.step.part = part;
      this.step.partAt = Date.now();
    }
    this.step.doing = typeof e['detail'] === 'string' ? e['detail'] : (DOING[e.msg] ?? e.msg);
    this.draw();
  }

  /** A step's finished part (the kernel inside the guest image) gets a line of its own. */
  private closePart(): void {
    const s = this.step;
    if (!s?.part) return;
    this.clearLine();
    this.out.write(`     ${this.styles.dim('-')} ${s.part} ${this.styles.dim(seconds(Date.now() - s.partAt))}\n`);
    s.part = undefined;
  }

  private clearLine(): void {
    if (this.out.isTTY) this.out.write('\r\x1b[2K');
  }

  private draw(): void {
    const s = this.step;
    if (!s || !this.out.isTTY) return;
    this.spin = (this.spin + 1) % SPINNER.length;
    const pct = /~?(\d{1,3})%/.exec(s.doing)?.[1];
    const head = `  ${SPINNER[this.spin]} ${s.title}${s.part ? `: ${s.part}` : ''}${pct ? ` ${pct}%` : ''} ${seconds(Date.now() - s.at)}`;
    const width = (this.out.columns || 100) - 1;
    const rest = s.doing ? ` ${s.doing}` : '';
    this.out.write(`\r\x1b[2K${head}${this.styles.dim(rest.slice(0, Math.max(0, width - head.length)))}`);
  }
}

function strip(e: LogFields): LogFields {
  const { t: _t, level: _l, name: _n, msg: _m, ...rest } = e;
  return rest;
}

function seconds(ms: number): string {
  const s = ms / 1000;
  return s >= 60 ? `${Math.floor(s / 60)}m${String(Math.floor(s % 60)).padStart(2, '0')}s` : `${s.toFixed(1)}s`;
}
