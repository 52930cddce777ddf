/**
 * Does a kernel config give hutch what it needs?
 *
 *   npx tsx kernel-configs/check.ts <path to .config or config.gz> [--json]
 *
 * Requirements come from the fragments in ./fragments: every `CONFIG_X=value`
 * line is required, except in 90-build-choices.config (size/speed trims that
 * another kernel may legitimately choose differently). `# ... is not set`
 * lines are never requirements. Exits 1 when anything required is missing or
 * has another value, 2 on bad usage.
 *
 * Also derives *capabilities* (idle page tracking, DAMON_RECLAIM, zswap, ...)
 * so the broker and the guest agent can say what a kernel lacks; the guest
 * agent can run the same rules on /proc/config.gz.
 */
import { readdirSync, readFileSync } from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { gunzipSync } from "node:zlib";
import { runAsScript } from "../build/run.ts";

/** Option name (with CONFIG_ prefix) -> value: "y", "m", "n" (is not set), or the literal value. */
export type KernelConfig = Map<string, string>;

export interface Requirement {
  option: string;
  value: string;
  /** The comment above the option in its fragment. */
  why: string;
  fragment: string;
}

export type Problem =
  | { kind: "missing"; option: string; expected: string; why: string }
  | { kind: "module"; option: string; expected: string; actual: "m"; why: string }
  | { kind: "wrong"; option: string; expected: string; actual: string; why: string };

export interface CheckResult {
  ok: boolean;
  problems: Problem[];
  checked: number;
  capabilities: Capability[];
}

export type CapabilityName =
  | "idle_page_tracking"
  | "damon_reclaim"
  | "zswap"
  | "zswap_zsmalloc"
  | "mglru"
  | "vsock"
  | "virtio_serial"
  | "page_reporting"
  | "userfaultfd"
  | "memcg"
  | "psi"
  | "pvh_boot";

export interface Capability {
  name: CapabilityName;
  /** Usable at all: every option is built in or a module. */
  available: boolean;
  /** "builtin": all options =y; "module": needs modules loaded; "missing": some option absent. */
  via: "builtin" | "module" | "missing";
  /** On without any runtime switch or command-line argument. */
  enabledByDefault: boolean;
  /** Options that are absent (for a missing capability). */
  lacking: string[];
  description: string;
}

interface CapabilityRule {
  name: CapabilityName;
  description: string;
  /** All must be y or m. */
  needs: string[];
  /** Extra options that make it on by default (besides `needs`). */
  defaultOn?: string[];
}

const CAPABILITY_RULES: readonly CapabilityRule[] = [
  { name: "idle_page_tracking", description: "/sys/kernel/mm/page_idle/bitmap, to record a call's activation set", needs: ["CONFIG_IDLE_PAGE_TRACKING", "CONFIG_PROC_PAGE_MONITOR"] },
  { name: "damon_reclaim", description: "DAMON-based proactive reclaim (damon_reclaim module parameters)", needs: ["CONFIG_DAMON", "CONFIG_DAMON_PADDR", "CONFIG_DAMON_RECLAIM"] },
  { name: "zswap", description: "compressed swap cache", needs: ["CONFIG_SWAP", "CONFIG_ZSWAP"], defaultOn: ["CONFIG_ZSWAP_DEFAULT_ON"] },
  { name: "zswap_zsmalloc", description: "zsmalloc as zswap's pool", needs: ["CONFIG_ZSWAP", "CONFIG_ZSMALLOC"], defaultOn: ["CONFIG_ZSWAP_ZPOOL_DEFAULT_ZSMALLOC"] },
  { name: "mglru", description: "multi-generational LRU", needs: ["CONFIG_LRU_GEN"], defaultOn: ["CONFIG_LRU_GEN_ENABLED"] },
  { name: "vsock", description: "virtio-vsock agent channel (Firecracker)", needs: ["CONFIG_VSOCKETS", "CONFIG_VIRTIO_VSOCKETS"] },
  { name: "virtio_serial", description: "virtio-serial agent channel (QEMU snapshots)", needs: ["CONFIG_VIRTIO_CONSOLE"] },
  { name: "page_reporting", description: "free page reporting to the host via virtio-balloon", needs: ["CONFIG_VIRTIO_BALLOON", "CONFIG_PAGE_REPORTING"] },
  { name: "userfaultfd", description: "userfaultfd", needs: ["CONFIG_USERFAULTFD"] },
  { name: "memcg", description: "cgroup v2 memory controller (memory.reclaim)", needs: ["CONFIG_CGROUPS", "CONFIG_MEMCG"] },
  { name: "psi", description: "pressure stall information", needs: ["CONFIG_PSI"] },
  { name: "pvh_boot", description: "boots from vmlinux via the PVH entry point", needs: ["CONFIG_PVH"] },
];

const HERE = path.dirname(fileURLToPath(import.meta.url));
export const FRAGMENTS_DIR = path.join(HERE, "fragments");
/** Fragments that shape the build but are not requirements. */
const NOT_REQUIREMENTS = new Set(["90-build-choices.config"]);

const SET_LINE = /^(CONFIG_[A-Za-z0-9_]+)=(.*)$/;
const UNSET_LINE = /^# (CONFIG_[A-Za-z0-9_]+) is not set$/;

/** Parse .config text. Quoted string values keep their quotes, as Kconfig writes them. */
export function parseConfig(text: string): KernelConfig {
  const config: KernelConfig = new Map();
  for (const raw of text.split("\n")) {
    const line = raw.trim();
    const set = SET_LINE.exec(line);
    if (set) {
      config.set(set[1]!, set[2]!);
      continue;
    }
    const unset = UNSET_LINE.exec(line);
    if (unset) config.set(unset[1]!, "n");
  }
  return config;
}

/** Every fragment file, in merge order (name order). */
export function fragmentFiles(dir = FRAGMENTS_DIR): string[] {
  return readdirSync(dir)
    .filter((f) => f.endsWith(".config"))
    .sort()
    .map((f) => path.join(dir, f));
}

/** The requirements stated by the fragments (see the file header for the rule). */
export function loadRequirements(dir = FRAGMENTS_DIR): Requirement[] {
  const out: Requirement[] = [];
  for (const file of fragmentFiles(dir)) {
    const fragment = path.basename(file);
    if (NOT_REQUIREMENTS.has(fragment)) continue;
    let why = "";
    for (const raw of readFileSync(file, "utf8").split("\n")) {
      const line = raw.trim();
      const set = SET_LINE.exec(line);
      if (set) {
        out.push({ option: set[1]!, value: set[2]!, why, fragment });
        why = "";
      } else if (line.startsWith("#") && !UNSET_LINE.test(line)) {
        why = line.replace(/^#\s*/, "");
      } else if (line === "") {
        why = "";
      }
    }
  }
  return out;
}

function isOn(value: string | undefined): boolean {
  return value === "y" || value === "m";
}

/** Which capabilities a config provides, and which it lacks. */
export function capabilitiesOf(config: KernelConfig | string): Capability[] {
  const cfg = typeof config === "string" ? parseConfig(config) : config;
  return CAPABILITY_RULES.map((rule) => {
    const lacking = rule.needs.filter((o) => !isOn(cfg.get(o)));
    const available = lacking.length === 0;
    const via = !available ? "missing" : rule.needs.every((o) => cfg.get(o) === "y") ? "builtin" : "module";
    const enabledByDefault = available && (rule.defaultOn ?? []).every((o) => cfg.get(o) === "y");
    return { name: rule.name, available, via, enabledByDefault, lacking, description: rule.description };
  });
}

/** Names of capabilities the config lacks entirely. */
export function missingCapabilities(config: KernelConfig | string): CapabilityName[] {
  return capabilitiesOf(config)
    .filter((c) => !c.available)
    .map((c) => c.name);
}

/**
 * Check a config against hutch's requirements. A required `=y` that is `=m`
 * is reported as kind "module": it works only with an initramfs/module loader,
 * which hutch's own kernel deliberately does without.
 */
export function checkConfig(configText: string, requirements: readonly Requirement[] = loadRequirements()): CheckResult {
  const config = parseConfig(configText);
  const problems: Problem[] = [];
  for (const req of requirements) {
    const actual = config.get(req.option);
    if (actual === req.value) continue;
    if (actual === undefined || actual === "n") {
      problems.push({ kind: "missing", option: req.option, expected: req.value, why: req.why });
    } else if (actual === "m" && req.value === "y") {
      problems.push({ kind: "module", option: req.option, expected: req.value, actual, why: req.why });
    } else {
      problems.push({ kind: "wrong", option: req.option, expected: req.value, actual, why: req.why });
    }
  }
  return { ok: problems.length === 0, problems, checked: requirements.length, capabilities: capabilitiesOf(config) };
}

/** Read a .config, or a gzip-compressed one (/proc/config.gz). */
export function readConfigFile(file: string): string {
  const data = readFileSync(file);
  const gz = data.length > 2 && data[0] === 0x1f && data[1] === 0x8b;
  return (gz ? gunzipSync(data) : data).toString("utf8");
}

function formatReport(file: string, result: CheckResult): string {
  const lines: string[] = [];
  if (result.ok) {
    lines.push(`${file}: all ${result.checked} required options present`);
  } else {
    lines.push(`${file}: ${result.problems.length} of ${result.checked} required options missing or different`);
    for (const p of result.problems) {
      const got = p.kind === "missing" ? "not set" : `=${p.actual}`;
      const note = p.kind === "module" ? " (module: needs an initramfs to load it)" : "";
      lines.push(`  ${p.option}: want =${p.expected}, have ${got}${note}${p.why ? `  # ${p.why}` : ""}`);
    }
  }
  lines.push("capabilities:");
  for (const c of result.capabilities) {
    const state = c.available ? `${c.via}${c.enabledByDefault ? "" : ", off by default"}` : `MISSING (${c.lacking.join(", ")})`;
    lines.push(`  ${c.name.padEnd(20)} ${state}`);
  }
  return lines.join("\n");
}

function main(argv: string[]): number {
  const json = argv.includes("--json");
  const files = argv.filter((a) => !a.startsWith("--"));
  if (argv.includes("--help") || files.length !== 1) {
    process.stderr.write("usage: npx tsx kernel-configs/check.ts <path to .config or config.gz> [--json]\n");
    return argv.includes("--help") ? 0 : 2;
  }
  const file = files[0]!;
  let text: string;
  try {
    text = readConfigFile(file);
  } catch (err) {
    process.stderr.write(`check: cannot read kernel config ${file}: ${(err as Error).message}\n`);
    return 2;
  }
  if (parseConfig(text).size === 0) {
    process.stderr.write(`check: ${file} has no CONFIG_ lines; is it a kernel config?\n`);
    return 2;
  }
  const result = checkConfig(text);
  process.stdout.write(`${json ? JSON.stringify({ file, ...result }) : formatReport(file, result)}\n`);
  return result.ok ? 0 : 1;
}

runAsScript(import.meta.url, "check", main);
