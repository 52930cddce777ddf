/**
 * Structured logs: one JSON object per line on stderr, so broker and agent logs can be
 * filtered with jq and shipped anywhere. Fields carry context; messages are stable names.
 */
export type LogLevel = 'debug' | 'info' | 'warn' | 'error';
export type LogFields = Record<string, unknown>;

export interface Logger {
  debug(msg: string, fields?: LogFields): void;
  info(msg: string, fields?: LogFields): void;
  warn(msg: string, fields?: LogFields): void;
  error(msg: string, fields?: LogFields): void;
  child(fields: LogFields): Logger;
}

const ORDER: Record<LogLevel, number> = { debug: 10, info: 20, warn: 30, error: 40 };

export function parseLogLevel(s: string | undefined, fallback: LogLevel = 'info'): LogLevel {
  return s === 'debug' || s === 'info' || s === 'warn' || s === 'error' ? s : fallback;
}

export function createLogger(opts: {
  name: string;
  level?: LogLevel;
  base?: LogFields;
  write?: (line: string) => void;
}): Logger {
  const min = ORDER[opts.level ?? parseLogLevel(process.env['HUTCH_LOG_LEVEL'])];
  const write = opts.write ?? ((line: string) => process.stderr.write(line + '\n'));
  const make = (base: LogFields): Logger => {
    const emit = (level: LogLevel, msg: string, fields?: LogFields) => {
      if (ORDER[level] < min) return;
      write(JSON.stringify({ t: new Date().toISOString(), level, name: opts.name, msg, ...base, ...fields }, safeReplacer));
    };
    return {
      debug: (m, f) => emit('debug', m, f),
      info: (m, f) => emit('info', m, f),
      warn: (m, f) => emit('warn', m, f),
      error: (m, f) => emit('error', m, f),
      child: (f) => make({ ...base, ...f }),
    };
  };
  return make(opts.base ?? {});
}

function safeReplacer(_key: string, value: unknown): unknown {
  if (value instanceof Error) return { name: value.name, message: value.message };
  if (typeof value === 'bigint') return value.toString();
  if (value instanceof Uint8Array) return `<${value.length} bytes>`;
  return value;
}

export const noopLogger: Logger = {
  debug: () => undefined,
  info: () => undefined,
  warn: () => undefined,
  error: () => undefined,
  child: () => noopLogger,
};
