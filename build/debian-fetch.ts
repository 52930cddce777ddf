/**
 * Fetch .deb files from any Debian suite (trixie, sid, bookworm-backports, ...)
 * without touching the host's package state.
 *
 * The host is Debian bookworm and must never be upgraded from newer suites, so
 * this module never uses the host's sources, lists or dpkg status. Each suite
 * gets a private apt tree under `<cache>/apt/<suite>/` (its own sources.list,
 * lists, archive cache and an empty dpkg status); `apt-get download` fetches
 * exactly the named packages (no dependencies are resolved or installed) into
 * `<cache>/downloads/`, verified against the signed Release file by apt. Callers
 * unpack with `extractDeb` (dpkg-deb -x), never `dpkg -i`.
 *
 * Idempotent: a package whose .deb is already in downloads with the checksum
 * the index expects is not fetched again, and the index is refreshed at most
 * once per `maxListAgeHours` (offline runs fall back to the stale index).
 */
import { createHash } from "node:crypto";
import { createReadStream } from "node:fs";
import { mkdir, readdir, rename, rm, stat, writeFile } from "node:fs/promises";
import path from "node:path";
import { cacheDir, downloadsDir, exists } from "./cache.ts";
import { capture, run } from "./run.ts";

export interface SuiteOptions {
  /** Debian suite or codename: "trixie", "sid", "bookworm-backports", ... */
  suite: string;
  /** Archive components; default ["main"]. */
  components?: string[];
  /** Mirror URL; default http://deb.debian.org/debian. */
  mirror?: string;
  /** Debian architecture; default amd64. */
  arch?: string;
  /** Keyring that signs the suite; default the host's debian-archive-keyring. */
  keyring?: string;
  /** Refresh the package index when older than this; default 24. */
  maxListAgeHours?: number;
  /** Progress messages. */
  log?: (message: string) => void;
}

/** The index fields of one binary package version (apt-cache show). */
export interface PackageRecord {
  name: string;
  version: string;
  arch: string;
  /** Pool path, e.g. pool/main/l/linux/linux-source-6.12_6.12.38-1_all.deb */
  filename: string;
  sha256: string;
  /** Raw Depends field ("" when none), for callers that follow metapackages. */
  depends: string;
  /** Every field as apt printed it. */
  fields: Record<string, string>;
}

export interface FetchedPackage extends PackageRecord {
  suite: string;
  /** Absolute path of the .deb in the downloads cache. */
  path: string;
}

const DEFAULT_MIRROR = "http://deb.debian.org/debian";
const DEFAULT_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg";

interface PrivateApt {
  root: string;
  /** apt options that redirect every piece of state into `root`. */
  options: string[];
}

async function privateApt(opts: SuiteOptions): Promise<PrivateApt> {
  const arch = opts.arch ?? "amd64";
  // The key includes the mirror/components so two callers with different
  // sources for the same suite do not share (and fight over) one index.
  const sourceLine = `deb [arch=${arch} signed-by=${opts.keyring ?? DEFAULT_KEYRING}] ${opts.mirror ?? DEFAULT_MIRROR} ${opts.suite} ${(opts.components ?? ["main"]).join(" ")}`;
  const slug = createHash("sha256").update(sourceLine).digest("hex").slice(0, 8);
  const root = await cacheDir("apt", `${opts.suite}-${arch}-${slug}`);
  for (const d of ["etc/sources.list.d", "etc/preferences.d", "state/lists/partial", "cache/archives/partial"]) {
    await mkdir(path.join(root, d), { recursive: true });
  }
  await writeFile(path.join(root, "etc/sources.list"), `${sourceLine}\n`);
  const status = path.join(root, "state/status");
  if (!(await exists(status))) await writeFile(status, "");
  const options = [
    `Dir::Etc::SourceList=${path.join(root, "etc/sources.list")}`,
    `Dir::Etc::SourceParts=${path.join(root, "etc/sources.list.d")}`,
    `Dir::Etc::Preferences=${path.join(root, "etc/preferences")}`,
    `Dir::Etc::PreferencesParts=${path.join(root, "etc/preferences.d")}`,
    `Dir::State=${path.join(root, "state")}`,
    `Dir::State::Lists=${path.join(root, "state/lists")}`,
    `Dir::State::status=${status}`,
    `Dir::Cache=${path.join(root, "cache")}`,
    `Dir::Cache::pkgcache=`,
    `Dir::Cache::srcpkgcache=`,
    `APT::Architecture=${arch}`,
    `APT::Architectures=${arch}`,
    `Acquire::Languages=none`,
    // The host may pin a default release (bookworm); it must not leak in here.
    `APT::Default-Release=`,
    // Downloads land in a root-owned cache dir; apt's _apt sandbox user could not write there.
    `APT::Sandbox::User=root`,
  ].flatMap((o) => ["-o", o]);
  return { root, options };
}

async function listsAgeHours(root: string): Promise<number> {
  const dir = path.join(root, "state/lists");
  const names = (await readdir(dir)).filter((n) => n.endsWith("_Release") || n.endsWith("_InRelease"));
  if (names.length === 0) return Infinity;
  const st = await stat(path.join(dir, names[0]!));
  return (Date.now() - st.mtimeMs) / 3_600_000;
}

async function ensureIndex(opts: SuiteOptions, apt: PrivateApt): Promise<void> {
  const age = await listsAgeHours(apt.root);
  if (age < (opts.maxListAgeHours ?? 24)) return;
  opts.log?.(`apt: updating private index for ${opts.suite}`);
  try {
    await run(["apt-get", ...apt.options, "-q", "update"]);
  } catch (err) {
    if (age === Infinity) {
      throw new Error(`cannot fetch the package index of Debian ${opts.suite}: ${(err as Error).message}`, { cause: err });
    }
    opts.log?.(`apt: index refresh for ${opts.suite} failed, using the one from ${age.toFixed(1)} h ago`);
  }
}

function parseRecord(text: string): Record<string, string> {
  const fields: Record<string, string> = {};
  let key = "";
  for (const line of text.split("\n")) {
    if (/^\s/.test(line) && key) {
      fields[key] += `\n${line.trim()}`;
      continue;
    }
    const m = /^([A-Za-z0-9-]+):\s?(.*)$/.exec(line);
    if (m) {
      key = m[1]!;
      fields[key] = m[2]!;
    }
  }
  return fields;
}

/** Look up the candidate version of `name` in `suite` (index refreshed if stale). */
export async function showPackage(opts: SuiteOptions, name: string): Promise<PackageRecord> {
  const apt = await privateApt(opts);
  await ensureIndex(opts, apt);
  let text: string;
  try {
    text = await capture(["apt-cache", ...apt.options, "show", "--no-all-versions", name]);
  } catch (err) {
    throw new Error(`package ${name} not found in Debian ${opts.suite}: ${(err as Error).message}`, { cause: err });
  }
  // A name can resolve to several records (one per architecture); keep ours.
  const arch = opts.arch ?? "amd64";
  const records = text.split(/\n\n+/).filter((r) => r.trim() !== "").map(parseRecord);
  const fields = records.find((f) => f["Architecture"] === arch || f["Architecture"] === "all") ?? records[0];
  if (!fields?.["Version"] || !fields["Filename"] || !fields["SHA256"]) {
    throw new Error(`package ${name} in Debian ${opts.suite} has no downloadable record (virtual package?)`);
  }
  return {
    name: fields["Package"] ?? name,
    version: fields["Version"],
    arch: fields["Architecture"] ?? arch,
    filename: fields["Filename"],
    sha256: fields["SHA256"],
    depends: fields["Depends"] ?? "",
    fields,
  };
}

async function sha256File(file: string): Promise<string> {
  const hash = createHash("sha256");
  for await (const chunk of createReadStream(file)) hash.update(chunk as Buffer);
  return hash.digest("hex");
}

/**
 * Download the named packages (exact names, no dependency resolution) from a
 * suite into the downloads cache; returns one record per name, in order.
 */
export async function fetchDebianPackages(opts: SuiteOptions, names: readonly string[]): Promise<FetchedPackage[]> {
  const apt = await privateApt(opts);
  const dest = await downloadsDir();
  const out: FetchedPackage[] = [];
  for (const name of names) {
    const rec = await showPackage(opts, name);
    const target = path.join(dest, path.basename(rec.filename));
    if ((await exists(target)) && (await sha256File(target)) === rec.sha256) {
      out.push({ ...rec, suite: opts.suite, path: target });
      continue;
    }
    opts.log?.(`apt: downloading ${rec.name} ${rec.version} from ${opts.suite}`);
    // apt-get download writes into its cwd; a private temp dir keeps a partial
    // file from ever appearing under the final name.
    const tmp = path.join(dest, `.partial-${process.pid}-${rec.name}`);
    await rm(tmp, { recursive: true, force: true });
    await mkdir(tmp);
    try {
      await run(["apt-get", ...apt.options, "-q", "download", `${rec.name}=${rec.version}`], { cwd: tmp });
      const files = (await readdir(tmp)).filter((f) => f.endsWith(".deb"));
      if (files.length !== 1) throw new Error(`apt-get download of ${rec.name} left ${files.length} .deb files in ${tmp}`);
      const got = path.join(tmp, files[0]!);
      const sum = await sha256File(got);
      if (sum !== rec.sha256) throw new Error(`checksum mismatch for ${rec.name} ${rec.version}: got ${sum}, index says ${rec.sha256}`);
      await rename(got, target);
    } finally {
      await rm(tmp, { recursive: true, force: true });
    }
    out.push({ ...rec, suite: opts.suite, path: target });
  }
  return out;
}

/** Unpack a .deb's data into `destDir` (dpkg-deb -x: no maintainer scripts run). */
export async function extractDeb(debPath: string, destDir: string): Promise<void> {
  await mkdir(destDir, { recursive: true });
  await run(["dpkg-deb", "-x", debPath, destDir]);
}
