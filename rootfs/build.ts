/**
 * Build (or find in the cache) hutch's guest root filesystem.
 *
 *   npx tsx rootfs/build.ts [--force] [--force-base] [--json]
 *
 * --force rebuilds the image layer (agent, init, config) from the cached base;
 * --force-base rebuilds the Debian base tree as well. Needs root. See
 * rootfs/README.md for the layout and what the guest's init does.
 */
import { runIfMain } from "./cli.ts";
import { ensureRootfs } from "./image.ts";
import { ensureAgentLayer } from "./agent-layer.ts";
import { fmtBytes, fmtSeconds } from "./progress.ts";

export { ensureRootfs, type RootfsImage, type RootfsOptions } from "./image.ts";
export { ensureAgentLayer, type AgentLayer } from "./agent-layer.ts";

const USAGE = `usage: npx tsx rootfs/build.ts [--force] [--force-base] [--json]
  builds (or finds in ~/.cache/hutch) the guest rootfs image and prints where it is
  --force       rebuild the image layer (agent, init, config) on the cached base
  --force-base  rebuild the Debian base tree too (minutes)
  --json        print one JSON object as the last line
`;

async function main(argv: string[]): Promise<number> {
  if (argv.includes("--help") || argv.includes("-h")) {
    process.stdout.write(USAGE);
    return 0;
  }
  const known = ["--force", "--force-base", "--json"];
  const unknown = argv.filter((a) => !known.includes(a));
  if (unknown.length > 0) {
    process.stderr.write(`rootfs/build: unknown argument(s) ${unknown.join(" ")}\n${USAGE}`);
    return 2;
  }
  const started = performance.now();
  const r = await ensureRootfs({ force: argv.includes("--force"), forceBase: argv.includes("--force-base") });
  const layer = await ensureAgentLayer({ force: argv.includes("--force") });
  const wall = (performance.now() - started) / 1000;
  if (argv.includes("--json")) {
    process.stdout.write(`${JSON.stringify({ ...r, agentLayer: layer, wallSeconds: Math.round(wall * 10) / 10 })}\n`);
    return 0;
  }
  process.stdout.write(
    [
      `${r.cached ? "cached" : "built"} rootfs ${r.hash}`,
      `  image:  ${r.image}`,
      `          ${fmtBytes(r.sizeBytes)} filesystem, ${fmtBytes(r.allocatedBytes)} on disk, image build ${fmtSeconds(r.buildSeconds)}`,
      `  base:   ${r.base.dir} (${r.base.cached ? "cached" : "built"})`,
      `          ${fmtBytes(r.base.sizeBytes)}, ${r.base.files} files, ${r.base.packages} packages, base build ${fmtSeconds(r.base.buildSeconds)}`,
      `  agent layer: ${layer.image} (${layer.cached ? "cached" : "built"}), ${fmtBytes(layer.sizeBytes)}, node ${layer.nodeVersion}, agent sha256 ${layer.agentSha256}`,
      `  this run: ${fmtSeconds(wall)}`,
      "",
    ].join("\n"),
  );
  return 0;
}

runIfMain(import.meta.url, "rootfs", main);
