/**
 * The entry-point boilerplate of the rootfs command-line tools: run `main`
 * only when the file is executed (not imported), turn its result into the exit
 * code and a thrown error into one readable line.
 */
import path from "node:path";
import { pathToFileURL } from "node:url";

export function runIfMain(moduleUrl: string, prefix: string, main: (argv: string[]) => Promise<number>): void {
  const entry = process.argv[1];
  if (!entry || moduleUrl !== pathToFileURL(path.resolve(entry)).href) return;
  main(process.argv.slice(2)).then(
    (code) => {
      process.exitCode = code;
    },
    (err: unknown) => {
      process.stderr.write(`[${prefix}] error: ${err instanceof Error ? err.message : String(err)}\n`);
      process.exitCode = 1;
    },
  );
}
