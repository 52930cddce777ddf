/**
 * Boot a guest kernel under QEMU microvm (TCG) N times and report what it can
 * do and how reliably and fast it boots.
 *
 *   npx tsx kernel-configs/boot-probe.ts [--kernel hutch|debian] [--runs N] [--smp N]
 *       [--timeout S] [--initramfs] [--vmlinux PATH] [--machine M] [--cpu C] [--append "x=y ..."]
 *       [--no-tcg-cmdline] [--quick] [--verbose] [--json]
 *
 * --quick makes the guest report only its boot (for timing loops).
 *
 * Each boot runs the probe root (probe-root.ts) as init on a read-only ext4
 * root (or as an initramfs with --initramfs), with a virtio-serial port named
 * `agent`, a swap disk, virtio-rng and a free-page-reporting balloon. It
 * measures wall time from QEMU's spawn to the first line of init, counts boots
 * that did not reach init before the timeout (hangs) and keeps their last
 * console lines. Defaults come from boot-params.ts; --machine/--cpu/--append
 * override them for experiments.
 */
import { spawn } from "node:child_process";
import { mkdtemp, rm, truncate, writeFile } from "node:fs/promises";
import { createConnection, type Socket } from "node:net";
import { tmpdir } from "node:os";
import path from "node:path";
import { packExt4, packInitramfs } from "../build/image-pack.ts";
import { hostTscKhz, kernelCmdline, microvmMachine, type KernelFlavor } from "./boot-params.ts";
import { runAsScript } from "../build/run.ts";
import { ensureKernel } from "./build.ts";
import { ensureDebianKernel } from "./debian-kernel.ts";
import { makeProbeRoot, PROBE_MARKER_INIT, PROBE_RESULT_PREFIX } from "./probe-root.ts";

export interface ProbeOptions {
  flavor: KernelFlavor;
  runs: number;
  smp: number;
  memMiB: number;
  timeoutSec: number;
  initramfs: boolean;
  machine?: string;
  /** Boot this vmlinux instead of the cached hutch kernel (no build). */
  vmlinux?: string;
  cpu: string;
  append: string[];
  tcgCmdline: boolean;
  verbose: boolean;
  log: (m: string) => void;
}

export interface BootRun {
  ok: boolean;
  /** Wall ms from spawn to the init's first line (undefined if never reached). */
  initMs?: number;
  /** Wall ms from spawn to QEMU's exit (or the kill on timeout). */
  totalMs: number;
  result?: Record<string, string>;
  /** Which channel delivered the result. */
  resultVia?: "virtio-serial" | "console";
  /** Last console lines, kept for failed boots. */
  consoleTail?: string[];
  failure?: string;
}

export interface ProbeReport {
  flavor: KernelFlavor;
  kernel: string;
  machine: string;
  cpu: string;
  smp: number;
  cmdline: string;
  runs: number;
  ok: number;
  hung: number;
  initMsMedian?: number;
  initMsP90?: number;
  initMsMin?: number;
  initMsMax?: number;
  guestUptimeAtInitMedian?: number;
  firstResult?: Record<string, string>;
  failures: { run: number; failure: string; consoleTail: string[] }[];
  raw: BootRun[];
}

interface BootFiles {
  kernel: string;
  initrd?: string;
  rootImage?: string;
  swapImage: string;
}

function percentile(sorted: number[], p: number): number | undefined {
  if (sorted.length === 0) return undefined;
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

async function prepareFiles(opts: ProbeOptions, work: string): Promise<BootFiles> {
  const rootDir = path.join(work, "probe-root");
  await makeProbeRoot(rootDir, opts.log);
  const swapImage = path.join(work, "swap.img");
  await writeFile(swapImage, "");
  await truncate(swapImage, 64 * 1024 * 1024);
  if (opts.flavor === "hutch") {
    const kernel = opts.vmlinux ?? (await ensureKernel({ log: opts.log })).vmlinux;
    if (opts.initramfs) {
      const initrd = path.join(work, "probe.cpio.gz");
      await packInitramfs(rootDir, initrd);
      return { kernel, initrd, swapImage };
    }
    const rootImage = path.join(work, "probe-root.ext4");
    await packExt4(rootDir, rootImage, 32, "probe");
    return { kernel, rootImage, swapImage };
  }
  const d = await ensureDebianKernel({ log: opts.log });
  const rootImage = path.join(work, "probe-root.ext4");
  await packExt4(rootDir, rootImage, 32, "probe");
  return { kernel: d.vmlinuz, initrd: d.initrd, rootImage, swapImage };
}

function qemuArgs(opts: ProbeOptions, files: BootFiles, sock: string, cmdline: string, machine: string): string[] {
  const args = [
    "-M", machine,
    "-accel", "tcg",
    "-cpu", opts.cpu,
    "-m", String(opts.memMiB),
    "-smp", String(opts.smp),
    "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
    "-serial", "stdio",
    "-kernel", files.kernel,
    "-append", cmdline,
  ];
  if (files.initrd) args.push("-initrd", files.initrd);
  // Device order decides the guest names: the root disk must come out as /dev/vda, swap as /dev/vdb.
  if (files.rootImage) {
    args.push("-drive", `id=root,file=${files.rootImage},format=raw,if=none,readonly=on`, "-device", "virtio-blk-device,drive=root");
  }
  args.push("-drive", `id=swap,file=${files.swapImage},format=raw,if=none`, "-device", "virtio-blk-device,drive=swap");
  args.push(
    "-device", "virtio-serial-device",
    "-chardev", `socket,id=ag,path=${sock},server=on,wait=off`,
    "-device", "virtserialport,chardev=ag,name=agent",
    "-device", "virtio-rng-device",
    "-device", "virtio-balloon-device,free-page-reporting=on",
  );
  return args;
}

/** Read one line starting with the result prefix from the agent socket (connect retried until QEMU creates it). */
function readAgentResult(sock: string, signal: AbortSignal): Promise<string | undefined> {
  return new Promise((resolve) => {
    let buf = "";
    let current: Socket | undefined;
    let settled = false;
    const finish = (v: string | undefined): void => {
      if (settled) return;
      settled = true;
      current?.destroy();
      resolve(v);
    };
    signal.addEventListener("abort", () => finish(undefined), { once: true });
    const attempt = (): void => {
      if (settled) return;
      const c = createConnection(sock);
      current = c;
      c.setEncoding("utf8");
      c.on("error", () => setTimeout(attempt, 20));
      c.on("data", (d: string) => {
        buf += d;
        const i = buf.indexOf(PROBE_RESULT_PREFIX);
        const nl = i >= 0 ? buf.indexOf("\n", i) : -1;
        if (nl >= 0) finish(buf.slice(i + PROBE_RESULT_PREFIX.length, nl));
      });
    };
    attempt();
  });
}

async function bootOnce(opts: ProbeOptions, files: BootFiles, work: string, cmdline: string, machine: string, runNo: number): Promise<BootRun> {
  const sock = path.join(work, `agent-${runNo}.sock`);
  await rm(sock, { force: true });
  const args = qemuArgs(opts, files, sock, cmdline, machine);
  if (opts.verbose && runNo === 0) opts.log(`qemu-system-x86_64 ${args.map((a) => (/\s/.test(a) ? `'${a}'` : a)).join(" ")}`);
  const started = performance.now();
  const child = spawn("qemu-system-x86_64", args, { stdio: ["ignore", "pipe", "pipe"] });
  const abort = new AbortController();
  const agentLine = readAgentResult(sock, abort.signal);
  const lines: string[] = [];
  let pending = "";
  let initMs: number | undefined;
  let consoleResult: string | undefined;
  let stderr = "";
  child.stdout.setEncoding("utf8").on("data", (d: string) => {
    pending += d;
    let nl: number;
    while ((nl = pending.indexOf("\n")) >= 0) {
      const line = pending.slice(0, nl).replace(/\r$/, "");
      pending = pending.slice(nl + 1);
      lines.push(line);
      if (lines.length > 400) lines.shift();
      if (opts.verbose) opts.log(`  | ${line}`);
      if (initMs === undefined && line.includes(PROBE_MARKER_INIT)) initMs = performance.now() - started;
      if (line.startsWith(PROBE_RESULT_PREFIX)) consoleResult = line.slice(PROBE_RESULT_PREFIX.length);
    }
  });
  child.stderr.setEncoding("utf8").on("data", (d: string) => {
    stderr += d;
  });
  let timedOut = false;
  const timer = setTimeout(() => {
    timedOut = true;
    child.kill("SIGKILL");
  }, opts.timeoutSec * 1000);
  const exit = await new Promise<number | null>((resolve) => child.on("close", (code) => resolve(code)));
  clearTimeout(timer);
  const totalMs = performance.now() - started;
  // Give the socket reader a moment to drain what QEMU wrote before exiting.
  const agentRaw = await Promise.race([agentLine, new Promise<undefined>((r) => setTimeout(() => r(undefined), 200))]);
  abort.abort();
  await rm(sock, { force: true });
  const raw = agentRaw ?? consoleResult;
  let result: Record<string, string> | undefined;
  if (raw) {
    try {
      result = JSON.parse(raw) as Record<string, string>;
    } catch {
      result = { unparsed: raw };
    }
  }
  const ok = initMs !== undefined && result !== undefined && !timedOut;
  const run: BootRun = { ok, initMs, totalMs, result, resultVia: agentRaw ? "virtio-serial" : consoleResult ? "console" : undefined };
  if (!ok) {
    run.failure = timedOut
      ? `no ${initMs === undefined ? "init" : "result"} within ${opts.timeoutSec} s`
      : `qemu exited with ${exit} before ${initMs === undefined ? "init" : "a result"}${stderr ? `: ${stderr.trim().slice(-300)}` : ""}`;
    run.consoleTail = [...lines.slice(-12), ...(pending ? [pending] : [])];
  }
  return run;
}

export async function probeBoots(opts: ProbeOptions): Promise<ProbeReport> {
  const work = await mkdtemp(path.join(tmpdir(), "hutch-probe-"));
  try {
    const files = await prepareFiles(opts, work);
    const machine = opts.machine ?? microvmMachine({ smp: opts.smp, flavor: opts.flavor });
    const tcgTscKhz = opts.tcgCmdline ? (await hostTscKhz()).khz : undefined;
    let cmdline = kernelCmdline({ flavor: opts.flavor, tcgTscKhz, extra: opts.append });
    if (opts.flavor === "hutch" && opts.initramfs) cmdline = cmdline.replace(/\broot=\S+\s+ro\s+rootfstype=ext4/, "rdinit=/init");
    const raw: BootRun[] = [];
    for (let i = 0; i < opts.runs; i++) {
      const r = await bootOnce(opts, files, work, cmdline, machine, i);
      raw.push(r);
      opts.log(`boot ${i + 1}/${opts.runs}: ${r.ok ? `init at ${r.initMs?.toFixed(0)} ms (guest uptime ${r.result?.["uptime_at_init"]} s), exit at ${r.totalMs.toFixed(0)} ms` : `FAILED: ${r.failure}`}`);
    }
    const okRuns = raw.filter((r) => r.ok);
    const initTimes = okRuns.map((r) => r.initMs!).sort((a, b) => a - b);
    const uptimes = okRuns.map((r) => Number(r.result?.["uptime_at_init"])).filter(Number.isFinite).sort((a, b) => a - b);
    return {
      flavor: opts.flavor,
      kernel: files.kernel,
      machine,
      cpu: opts.cpu,
      smp: opts.smp,
      cmdline,
      runs: opts.runs,
      ok: okRuns.length,
      hung: raw.filter((r) => r.failure?.startsWith("no ")).length,
      initMsMedian: percentile(initTimes, 50),
      initMsP90: percentile(initTimes, 90),
      initMsMin: initTimes[0],
      initMsMax: initTimes[initTimes.length - 1],
      guestUptimeAtInitMedian: percentile(uptimes, 50),
      firstResult: okRuns[0]?.result,
      failures: raw.flatMap((r, i) => (r.ok ? [] : [{ run: i + 1, failure: r.failure ?? "", consoleTail: r.consoleTail ?? [] }])),
      raw,
    };
  } finally {
    await rm(work, { recursive: true, force: true });
  }
}

function parseArgs(argv: string[]): ProbeOptions & { json: boolean } {
  const opts: ProbeOptions & { json: boolean } = {
    flavor: "hutch",
    runs: 1,
    smp: 1,
    memMiB: 256,
    timeoutSec: 30,
    initramfs: false,
    cpu: "max",
    append: [],
    tcgCmdline: true,
    verbose: false,
    json: false,
    log: (m) => process.stderr.write(`[probe] ${m}\n`),
  };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i]!;
    const val = (): string => {
      const v = argv[++i];
      if (v === undefined) throw new Error(`${a} needs a value`);
      return v;
    };
    const num = (): number => {
      const v = Number(val());
      if (!Number.isFinite(v) || v <= 0) throw new Error(`${a} needs a positive number`);
      return v;
    };
    switch (a) {
      case "--kernel": {
        const v = val();
        if (v !== "hutch" && v !== "debian") throw new Error(`--kernel must be hutch or debian, not ${v}`);
        opts.flavor = v;
        break;
      }
      case "--runs": opts.runs = num(); break;
      case "--smp": opts.smp = num(); break;
      case "--mem": opts.memMiB = num(); break;
      case "--timeout": opts.timeoutSec = num(); break;
      case "--initramfs": opts.initramfs = true; break;
      case "--machine": opts.machine = val(); break;
      case "--vmlinux": opts.vmlinux = val(); break;
      case "--cpu": opts.cpu = val(); break;
      case "--append": opts.append.push(...val().split(/\s+/).filter(Boolean)); break;
      case "--no-tcg-cmdline": opts.tcgCmdline = false; break;
      case "--quick": opts.append.push("hutch.probe=quick"); break;
      case "--verbose": opts.verbose = true; break;
      case "--json": opts.json = true; break;
      case "--help":
        process.stdout.write(
          "usage: npx tsx kernel-configs/boot-probe.ts [--kernel hutch|debian] [--runs N] [--smp N] [--mem MiB] [--timeout S]\n" +
            "         [--initramfs] [--vmlinux PATH] [--machine M] [--cpu C] [--append 'k=v ...'] [--no-tcg-cmdline] [--quick] [--verbose] [--json]\n",
        );
        process.exit(0);
      default:
        throw new Error(`unknown argument ${a}; see --help`);
    }
  }
  return opts;
}

async function main(argv: string[]): Promise<number> {
  let opts: ReturnType<typeof parseArgs>;
  try {
    opts = parseArgs(argv);
  } catch (err) {
    process.stderr.write(`boot-probe: ${(err as Error).message}\n`);
    return 2;
  }
  const report = await probeBoots(opts);
  const summary = { ...report, raw: undefined };
  if (opts.json) {
    process.stdout.write(`${JSON.stringify({ ...report, raw: report.raw.map((r) => ({ ok: r.ok, initMs: r.initMs, totalMs: r.totalMs, resultVia: r.resultVia, clocksource: r.result?.["clocksource"], uptimeAtInit: r.result?.["uptime_at_init"], failure: r.failure, consoleTail: r.consoleTail })) })}\n`);
  } else {
    process.stdout.write(`${JSON.stringify(summary, null, 2)}\n`);
  }
  return report.ok === report.runs ? 0 : 1;
}

runAsScript(import.meta.url, "boot-probe", main);
