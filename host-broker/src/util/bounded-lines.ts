import type { Readable } from 'node:stream';

/**
 * Lines from a byte stream that someone else writes, holding at most `maxLineBytes` of
 * any line. readline keeps a line whole until its newline comes, so a process that never
 * writes one (a guest writing its serial console as root, a QEMU that is no longer ours
 * writing its monitor socket) grows the broker's heap without bound. Past the limit a
 * line's bytes are counted and dropped; the line is delivered, cut, when its newline (or
 * the stream's end) arrives.
 */
export interface LineSink {
  /** `cutBytes`: bytes of this line dropped past the limit (0: the line is whole). */
  (line: string, cutBytes: number): void;
}

/** `onOverflow` is called the moment a line first passes the limit (before its end arrives). */
export function boundedLines(input: Readable, maxLineBytes: number, onLine: LineSink, onOverflow?: () => void): void {
  let parts: Buffer[] = [];
  let held = 0;
  let cut = 0;
  const take = (seg: Buffer) => {
    const room = maxLineBytes - held;
    if (seg.length > room) {
      if (cut === 0) onOverflow?.();
      cut += seg.length - room;
      seg = seg.subarray(0, room);
    }
    if (seg.length) {
      // A copy: the chunk may be large and the line small; keep only what the line needs.
      parts.push(Buffer.from(seg));
      held += seg.length;
    }
  };
  const emit = () => {
    let line = parts.length === 1 ? (parts[0] as Buffer).toString('utf8') : Buffer.concat(parts, held).toString('utf8');
    if (line.endsWith('\r')) line = line.slice(0, -1);
    const c = cut;
    parts = [];
    held = 0;
    cut = 0;
    onLine(line, c);
  };
  input.on('data', (chunk: Buffer | string) => {
    const buf = typeof chunk === 'string' ? Buffer.from(chunk) : chunk;
    let from = 0;
    for (let nl = buf.indexOf(10, from); nl >= 0; nl = buf.indexOf(10, from)) {
      take(buf.subarray(from, nl));
      emit();
      from = nl + 1;
    }
    if (from < buf.length) take(buf.subarray(from));
  });
  input.on('end', () => {
    if (held > 0 || cut > 0) emit();
  });
}
