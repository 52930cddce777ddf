/**
 * The agent layer: everything hutch runs in a guest, on a read-only ext4 disk of its own,
 * so a template's root filesystem (the user's image) needs nothing from hutch.
 *
 * The layer is the kernel's root (/dev/vda): its /sbin/init (guest/init.sh) mounts the
 * template's root (the second disk) as an overlay, moves itself to /opt/hutch inside it
 * and pivots there. It holds:
 *   sbin/init, agent-start.sh, build.sh    hutch's init, the agent launcher, the template builder
 *   bin/busybox (+ applet links), bin/sh   a static busybox: every tool init and build use
 *   bin/tini                               tini-static: PID 1, reaps orphans
 *   bin/node -> libexec/node + lib/        Debian's nodejs with every library it loads and
 *                                          Debian's glibc, run through lib/ld-linux-x86-64.so.2
 *                                          (--library-path): the template's libc never matters;
 *   nodejs/                                node's externalized builtins (relocateNodeBuiltins)
 *   hutch-agent.mjs, hutch-{madvise,spawn,resume}, agent-flags, layer.json
 *
 * Node: Debian's own `nodejs` (bookworm, the base tree's) rather than nodejs.org's binary:
 * it comes from the same signed, pinned-by-version Debian archive as the rest of the base,
 * needs no second download channel, and its libraries (libnode, ICU, OpenSSL, libuv) are
 * taken from the same tree by the loader's own resolution (`ld.so --list`), so the set is
 * exactly what node loads. Cached under `<cache>/agent-layer/<hash>/agent.ext4`; the key
 * covers the base, the agent bundle, the helpers, busybox and the guest scripts: an agent
 * change rebuilds this layer (seconds) and no template.
 */
import { chmod, copyFile, mkdir, mkdtemp, readdir, readFile, realpath, rm, symlink, writeFile } from "node:fs/promises";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { buildAgent } from "../guest-agent/build.ts";
import { buildNativeHelpers } from "../guest-agent/native/build.ts";
import { ensureStaticBusybox } from "../build/busybox.ts";
import { cacheDir, cacheRoot, exists, fillAtomically, hashInputs, notCached, withLock } from "../build/cache.ts";
import { ensureHostPackages } from "../build/host-apt.ts";
import { capture, run } from "../build/run.ts";
import { ensureBase } from "./base.ts";
import { makeReproducibleExt4 } from "./ext4.ts";
import { epochFromEnv, guestAgentFlags, sha256File, STAGING_PARENT, uuidFor } from "./image.ts";
import { pruneCache } from "./prune.ts";
import { defaultLog, fmtBytes, fmtSeconds, Phases, type LogFn } from "./progress.ts";

const HERE = path.dirname(fileURLToPath(import.meta.url));
const GUEST_DIR = path.join(HERE, "guest");

/** Scripts of the layer, with their place in it. Part of the key. */
export const LAYER_SCRIPTS: readonly { src: string; dest: string; mode: number }[] = [
  { src: path.join(GUEST_DIR, "init.sh"), dest: "sbin/init", mode: 0o755 },
  { src: path.join(GUEST_DIR, "agent-start.sh"), dest: "agent-start.sh", mode: 0o755 },
  { src: path.join(GUEST_DIR, "build.sh"), dest: "build.sh", mode: 0o755 },
  { src: path.join(GUEST_DIR, "git-proxy.sh"), dest: "bin/git-proxy", mode: 0o755 },
];

/**
 * The host's CA bundle, carried as ca-certificates.crt: tenant tools trust what the host
 * trusts (a host behind a TLS-inspecting proxy has that proxy's CA in it; the guest's
 * HTTPS goes out through the host). Absent on the host: Debian's bundle from the base.
 */
const HOST_CA_BUNDLE = process.env["HUTCH_GUEST_CA_BUNDLE"] ?? "/etc/ssl/certs/ca-certificates.crt";
async function caBundle(baseTree: string): Promise<string | undefined> {
  for (const f of [HOST_CA_BUNDLE, path.join(baseTree, "etc/ssl/certs/ca-certificates.crt")]) if (await exists(f)) return f;
  return undefined;
}
const BUILD_CODE = ["agent-layer.ts", "ext4.ts"].map((f) => path.join(HERE, f));

/** Where the layer is mounted inside a template's root (the agent's helper paths assume it). */
export const LAYER_MOUNT = "/opt/hutch";
const KEEP_LAYERS = 3;

/** What layer.json records next to the image. */
interface LayerInfo {
  hash: string;
  agentSha256: string;
  imageSha256: string;
  sizeBytes: number;
  buildSeconds: number;
  nodeVersion: string;
  libraries: string[];
  builtAt: string;
}

export interface AgentLayer extends Omit<LayerInfo, "libraries" | "builtAt"> {
  /** Path of agent.ext4: attach read-only as the VM's first virtio-blk disk (the kernel's root). */
  image: string;
  cached: boolean;
}

/**
 * The shared objects node loads, as the base tree's own loader resolves them (run on the
 * host against the base's directories: Debian's ld.so from our own debootstrap, not a
 * tenant's file).
 */
async function nodeLibraries(tree: string): Promise<{ loader: string; libs: string[] }> {
  const loader = await realpath(path.join(tree, "lib64/ld-linux-x86-64.so.2")).catch(async () =>
    realpath(path.join(tree, "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2")),
  );
  const libDirs = ["usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu"].map((d) => path.join(tree, d)).join(":");
  const out = await capture([loader, "--library-path", libDirs, "--list", path.join(tree, "usr/bin/node")]);
  const libs: string[] = [];
  for (const line of out.split("\n")) {
    const m = /=>\s+(\S+)\s+\(/.exec(line);
    if (!m?.[1] || m[1].includes("ld-linux")) continue;
    if (!m[1].startsWith(tree)) throw new Error(`node's library ${m[1]} resolved outside the base tree ${tree}`);
    libs.push(m[1]);
  }
  if (libs.length === 0) throw new Error(`ld.so --list found no libraries for ${tree}/usr/bin/node:\n${out}`);
  return { loader, libs };
}

/**
 * Debian builds node with some builtins kept outside libnode ("externalized": acorn,
 * cjs-module-lexer, undici), loaded at startup from absolute paths under /usr/share/nodejs/,
 * which is the template's root once init pivots. The layer's copy of libnode gets that
 * prefix rewritten to the same-length /opt/hutch/nodejs/ (only inside those path strings:
 * nothing else moves) and carries exactly the files it names. Refuses a libnode whose
 * external paths it does not recognise, rather than boot an agent that aborts.
 */
const DEBIAN_BUILTINS = "/usr/share/nodejs/";
const LAYER_BUILTINS = `${LAYER_MOUNT}/nodejs/`;
async function relocateNodeBuiltins(tree: string, stage: string): Promise<void> {
  if (DEBIAN_BUILTINS.length !== LAYER_BUILTINS.length) throw new Error("the builtins path rewrite must keep the length");
  const lib = (await readdir(path.join(stage, "lib"))).find((n) => n.startsWith("libnode.so"));
  if (!lib) return; // a node with everything built in
  const file = path.join(stage, "lib", lib);
  const bytes = await readFile(file);
  const from = Buffer.from(DEBIAN_BUILTINS);
  const to = Buffer.from(LAYER_BUILTINS);
  const needed = new Set<string>();
  for (let i = bytes.indexOf(from); i >= 0; i = bytes.indexOf(from, i + 1)) {
    const end = bytes.indexOf(0, i);
    const str = bytes.subarray(i, end).toString("latin1");
    const m = /^\/usr\/share\/nodejs\/([A-Za-z0-9_./-]+\.js)/.exec(str);
    // The gyp config string names them too (inside a JSON blob): rewritten, nothing to copy.
    if (m?.[1] && str === `${DEBIAN_BUILTINS}${m[1]}`) needed.add(m[1]);
    to.copy(bytes, i);
  }
  if (needed.size === 0) throw new Error(`${lib} mentions ${DEBIAN_BUILTINS} but names no builtin file`);
  await writeFile(file, bytes);
  for (const rel of [...needed].sort()) {
    const dest = path.join(stage, "nodejs", rel);
    await mkdir(path.dirname(dest), { recursive: true });
    await copyFile(await realpath(path.join(tree, DEBIAN_BUILTINS, rel)), dest);
  }
}

async function readCached(dir: string): Promise<LayerInfo | undefined> {
  if (!(await exists(path.join(dir, "agent.ext4"))) || !(await exists(path.join(dir, "layer.json")))) return undefined;
  return JSON.parse(await readFile(path.join(dir, "layer.json"), "utf8")) as LayerInfo;
}

function toResult(dir: string, info: LayerInfo, cached: boolean): AgentLayer {
  return {
    image: path.join(dir, "agent.ext4"),
    hash: info.hash,
    agentSha256: info.agentSha256,
    imageSha256: info.imageSha256,
    sizeBytes: info.sizeBytes,
    buildSeconds: info.buildSeconds,
    nodeVersion: info.nodeVersion,
    cached,
  };
}

/** The agent layer for the current agent, helpers and scripts; built (seconds) on a cache miss. */
export async function ensureAgentLayer(opts: { force?: boolean; log?: LogFn; cachedOnly?: boolean } = {}): Promise<AgentLayer> {
  const log = opts.log ?? defaultLog;
  if (process.getuid?.() !== 0) throw new Error("building the agent layer needs root (file ownership in the image)");
  const base = await ensureBase({ log, ...(opts.cachedOnly ? { cachedOnly: true } : {}) });
  const root = await cacheDir("agent-layer");
  const work = await mkdtemp(path.join(root, ".agent-"));
  try {
    // The agent and the helpers are rebuilt every time (about a second): their sha256 is the key.
    const agentFile = path.join(work, "hutch-agent.mjs");
    const agent = await buildAgent(agentFile);
    await ensureHostPackages(["gcc", "libc6-dev"], log);
    const helpers = await buildNativeHelpers(work);
    const busybox = await ensureStaticBusybox(log);
    const epoch = epochFromEnv();
    const ca = await caBundle(base.tree);
    const hash = await hashInputs([
      ...(ca ? [{ label: "ca-bundle", value: await sha256File(ca) }] : []),
      { label: "base", value: base.info.hash },
      { label: "agent", value: agent.sha256 },
      ...helpers.map((h) => ({ label: h.dest, value: h.sha256 })),
      { label: "busybox", value: await sha256File(busybox) },
      { label: "epoch", value: String(epoch) },
      ...LAYER_SCRIPTS.map((f) => ({ file: f.src })),
      ...BUILD_CODE.map((file) => ({ file })),
    ]);
    const dir = path.join(root, hash);
    if (!opts.force) {
      const hit = await readCached(dir);
      if (hit) return toResult(dir, hit, true);
    }
    if (opts.cachedOnly) notCached("the agent layer for this agent", dir);
    await ensureHostPackages(["e2fsprogs", "tar", "findutils"], log);
    return await withLock(
      path.join(cacheRoot(), "agent-layer", `${hash}.lock`),
      async () => {
        if (!opts.force) {
          const hit = await readCached(dir);
          if (hit) return toResult(dir, hit, true);
        }
        const phases = new Phases("agent layer", log);
        let info: LayerInfo | undefined;
        await fillAtomically(dir, async (tmp) => {
          const stage = await mkdtemp(path.join(STAGING_PARENT, `hutch-agent-layer-${hash}-`));
          try {
            const { libraries, nodeVersion } = await phases.run("stage node, glibc, busybox, tini, agent", async () => {
              for (const d of ["bin", "sbin", "lib", "libexec", "proc", "sys", "dev", "run", "newroot"]) await mkdir(path.join(stage, d), { recursive: true });
              await copyFile(busybox, path.join(stage, "bin/busybox"));
              await chmod(path.join(stage, "bin/busybox"), 0o755);
              const applets = (await capture([busybox, "--list"])).split("\n").filter((a) => /^[a-z0-9_.[-]+$/.test(a) && a !== "busybox");
              // Sorted: the directory's creation order is the image's entry order (stage.ts).
              for (const a of applets.sort()) await symlink("busybox", path.join(stage, "bin", a));
              await copyFile(path.join(base.tree, "usr/bin/tini-static"), path.join(stage, "bin/tini"));
              await chmod(path.join(stage, "bin/tini"), 0o755);
              const { loader, libs } = await nodeLibraries(base.tree);
              await copyFile(loader, path.join(stage, "lib/ld-linux-x86-64.so.2"));
              for (const lib of libs) await copyFile(lib, path.join(stage, "lib", path.basename(lib)));
              await relocateNodeBuiltins(base.tree, stage);
              await copyFile(path.join(base.tree, "usr/bin/node"), path.join(stage, "libexec/node"));
              await chmod(path.join(stage, "libexec/node"), 0o755);
              await writeFile(
                path.join(stage, "bin/node"),
                `#!${LAYER_MOUNT}/bin/sh\n# Node with the layer's own glibc and libraries, whatever the template's root holds.\nexec ${LAYER_MOUNT}/lib/ld-linux-x86-64.so.2 --library-path ${LAYER_MOUNT}/lib ${LAYER_MOUNT}/libexec/node "$@"\n`,
                { mode: 0o755 },
              );
              for (const f of LAYER_SCRIPTS) {
                await copyFile(f.src, path.join(stage, f.dest));
                await chmod(path.join(stage, f.dest), f.mode);
              }
              if (ca) await copyFile(ca, path.join(stage, "ca-certificates.crt"));
              await copyFile(agentFile, path.join(stage, "hutch-agent.mjs"));
              await chmod(path.join(stage, "hutch-agent.mjs"), 0o644);
              for (const h of helpers) {
                const dest = path.join(stage, path.relative(LAYER_MOUNT.slice(1), h.dest));
                await copyFile(h.path, dest);
                await chmod(dest, 0o755);
              }
              const flags = guestAgentFlags();
              await writeFile(path.join(stage, "agent-flags"), flags.map((f) => `${f}\n`).join(""));
              const nodeVersion = (base.info.installed.find((p) => p.startsWith("nodejs=")) ?? "nodejs=?").slice("nodejs=".length);
              const libraries = libs.map((l) => path.basename(l)).sort();
              await writeFile(
                path.join(stage, "layer.json"),
                `${JSON.stringify({ hash, baseHash: base.info.hash, agentSha256: agent.sha256, nodeVersion, libraries, agentFlags: flags, epoch }, null, 2)}\n`,
              );
              await run(["chown", "-R", "-h", "0:0", stage]);
              await run(["sh", "-c", 'find "$1" -print0 | xargs -0 touch -h -d "@$2"', "sh", stage, String(epoch)]);
              return { libraries, nodeVersion };
            });
            const image = path.join(tmp, "agent.ext4");
            const fs = await phases.run("mkfs.ext4 -d (reproducible)", () =>
              makeReproducibleExt4({ dir: stage, out: image, epoch, uuid: uuidFor(`agent-layer:${hash}`), label: "hutch-agent", log }),
            );
            const imageSha256 = await sha256File(image);
            info = {
              hash,
              agentSha256: agent.sha256,
              imageSha256,
              sizeBytes: fs.sizeBytes,
              buildSeconds: Math.round(phases.elapsed() * 10) / 10,
              nodeVersion,
              libraries,
              builtAt: new Date().toISOString(),
            };
            await writeFile(path.join(tmp, "layer.json"), `${JSON.stringify(info, null, 2)}\n`);
          } finally {
            await rm(stage, { recursive: true, force: true });
          }
        });
        if (!info) throw new Error("agent layer build finished without build info");
        await pruneCache(root, hash, KEEP_LAYERS, log);
        log(`agent layer ${hash}: ${fmtBytes(info.sizeBytes)}, node ${info.nodeVersion}, built in ${fmtSeconds(info.buildSeconds)}`);
        return toResult(dir, info, false);
      },
      log,
    );
  } finally {
    await rm(work, { recursive: true, force: true });
  }
}
