/**
 * Installs the Debian packages hutch uses (build/host-packages.ts), what the container
 * image's build runs before the sources are copied in (so a code change does not redo it):
 *
 *   node --import tsx build/install-host-packages.ts [--tests]
 */
import { installHostPackages } from "./host-packages.ts";
import { runAsScript } from "./run.ts";

runAsScript(import.meta.url, "install-host-packages", async (argv) => {
  const r = await installHostPackages((m) => process.stderr.write(`${m}\n`), { tests: argv.includes("--tests") });
  process.stderr.write(r.installed.length ? `installed ${r.installed.join(" ")}\n` : "all present\n");
  return 0;
});
