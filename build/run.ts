/**
 * Running host commands from the build scripts: one spawn wrapper so every
 * builder streams output the same way and fails with the same context
 * (command, cwd, exit status, the tail of stderr).
 */
import { spawn, type SpawnOptions } from "node:child_process";
import path from "node:path";
import { pathToFileURL } from "node:url";

export interface RunOptions {
  cwd?: string;
  env?: NodeJS.ProcessEnv;
  /** Called for every complete line of stdout/stderr (streamed, not buffered to the end). */
  onLine?: (line: string, stream: "stdout" | "stderr") => void;
  /** Keep stdout in the result (off for chatty commands like make). */
  captureStdout?: boolean;
  /** Bytes given to the child's stdin, then stdin is closed. */
  input?: string | Buffer;
  /** Kill the child (SIGKILL) after this many ms. */
  timeoutMs?: number;
}

export interface RunResult {
  stdout: string;
  /** The last ~64 KiB of stderr, for error messages. */
  stderrTail: string;
}

export class CommandError extends Error {
  constructor(
    message: string,
    readonly command: readonly string[],
    readonly exitCode: number | null,
    readonly signal: NodeJS.Signals | null,
    readonly stderrTail: string,
  ) {
    super(message);
    this.name = "CommandError";
  }
}

const STDERR_TAIL_BYTES = 64 * 1024;

function lineSplitter(emit: (line: string) => void): { push(chunk: string): void; end(): void } {
  let pending = "";
  return {
    push(chunk) {
      pending += chunk;
      let nl: number;
      while ((nl = pending.indexOf("\n")) !== -1) {
        emit(pending.slice(0, nl));
        pending = pending.slice(nl + 1);
      }
    },
    end() {
      if (pending !== "") emit(pending);
      pending = "";
    },
  };
}

/** Run `argv` to completion; rejects with a CommandError unless it exits 0. */
export function run(argv: readonly string[], opts: RunOptions = {}): Promise<RunResult> {
  const [cmd, ...args] = argv;
  if (cmd === undefined) return Promise.reject(new Error("run: empty command"));
  const spawnOpts: SpawnOptions = {
    cwd: opts.cwd,
    env: opts.env ?? process.env,
    stdio: [opts.input === undefined ? "ignore" : "pipe", "pipe", "pipe"],
  };
  return new Promise((resolve, reject) => {
    const child = spawn(cmd, args, spawnOpts);
    let stdout = "";
    let stderrTail = "";
    const outLines = lineSplitter((l) => opts.onLine?.(l, "stdout"));
    const errLines = lineSplitter((l) => opts.onLine?.(l, "stderr"));
    child.stdout?.setEncoding("utf8").on("data", (chunk: string) => {
      if (opts.captureStdout) stdout += chunk;
      outLines.push(chunk);
    });
    child.stderr?.setEncoding("utf8").on("data", (chunk: string) => {
      stderrTail = (stderrTail + chunk).slice(-STDERR_TAIL_BYTES);
      errLines.push(chunk);
    });
    if (opts.input !== undefined) child.stdin?.end(opts.input);
    let timer: NodeJS.Timeout | undefined;
    let timedOut = false;
    if (opts.timeoutMs !== undefined) {
      timer = setTimeout(() => {
        timedOut = true;
        child.kill("SIGKILL");
      }, opts.timeoutMs);
    }
    child.on("error", (err) => {
      if (timer) clearTimeout(timer);
      reject(new CommandError(`cannot start ${cmd}: ${err.message}`, argv, null, null, ""));
    });
    child.on("close", (code, signal) => {
      if (timer) clearTimeout(timer);
      outLines.end();
      errLines.end();
      if (code === 0) {
        resolve({ stdout, stderrTail });
        return;
      }
      const why = timedOut ? `timed out after ${opts.timeoutMs} ms` : signal ? `killed by ${signal}` : `exited with ${code}`;
      const tail = stderrTail.trim().split("\n").slice(-15).join("\n");
      reject(
        new CommandError(
          `command ${why}: ${argv.join(" ")}${opts.cwd ? ` (in ${opts.cwd})` : ""}${tail ? `\n--- stderr tail ---\n${tail}` : ""}`,
          argv,
          code,
          signal,
          stderrTail,
        ),
      );
    });
  });
}

/** Run and return stdout (trimmed of the final newline). */
export async function capture(argv: readonly string[], opts: Omit<RunOptions, "captureStdout"> = {}): Promise<string> {
  const { stdout } = await run(argv, { ...opts, captureStdout: true });
  return stdout.replace(/\n$/, "");
}

/**
 * Run `main` when the calling module is the script node was started with
 * (`npx tsx some/script.ts`), not when it is imported. Its return value
 * becomes the exit code; a thrown error is printed with `label` and exits 1.
 */
export function runAsScript(moduleUrl: string, label: string, main: (argv: string[]) => Promise<number> | number): void {
  const script = process.argv[1];
  if (!script || moduleUrl !== pathToFileURL(path.resolve(script)).href) return;
  Promise.resolve()
    .then(() => main(process.argv.slice(2)))
    .then(
      (code) => {
        process.exitCode = code;
      },
      (err: unknown) => {
        process.stderr.write(`${label}: error: ${err instanceof Error ? err.message : String(err)}\n`);
        process.exitCode = 1;
      },
    );
}
