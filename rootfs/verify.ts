/**
 * Boot the guest rootfs under QEMU and check it through the agent, printing
 * what was found and how long things took.
 *
 *   npx tsx rootfs/verify.ts [--boots N] [--compare-preload] [--append "k=v ..."] [--json] [--verbose]
 *
 * --boots N          boot N times for the boot-to-ready timing (facts come from the first)
 * --compare-preload  one more boot with hutch.preload=0, to compare Python's first import
 * --append "..."     extra kernel parameters for every boot (e.g. hutch.preload_node=1)
 * --cpu MODEL        QEMU -cpu model instead of boot-params.ts's (experiments)
 * Kernel: $HUTCH_GUEST_KERNEL (hutch | debian | path), else the newest cached
 * hutch kernel, else Debian's (see qemu-boot.ts). Accelerator: TCG.
 */
import { AgentClient } from "../host-broker/src/agent-client.ts";
import { gatherFacts, timeTwice, type GuestFacts, type Timing } from "./guest-facts.ts";
import { runIfMain } from "./cli.ts";
import { ensureRootfs } from "./image.ts";
import { ensureAgentLayer } from "./agent-layer.ts";
import { fmtBytes } from "./progress.ts";
import { bootRootfs, findGuestKernel, type BootedVm, type GuestKernel } from "./qemu-boot.ts";

interface BootReport {
  readyMs: number;
  readyUptime: number;
  helloMs: number;
  python?: Timing;
  node?: Timing;
}

function median(xs: number[]): number | undefined {
  const s = [...xs].sort((a, b) => a - b);
  if (s.length === 0) return undefined;
  const mid = Math.floor(s.length / 2);
  return s.length % 2 ? s[mid] : ((s[mid - 1] ?? 0) + (s[mid] ?? 0)) / 2;
}

async function connect(vm: BootedVm): Promise<{ client: AgentClient; helloMs: number; agentPid: number }> {
  const t0 = performance.now();
  const client = await AgentClient.connectUnix(vm.agentSocket, { handshakeTimeoutMs: 60_000 });
  const helloMs = performance.now() - t0;
  const agentPid = Number(client.capabilities["pid"]);
  if (!Number.isInteger(agentPid)) throw new Error(`agent hello has no pid: ${JSON.stringify(client.capabilities)}`);
  return { client, helloMs, agentPid };
}

async function oneBoot(
  image: string,
  agentLayer: string,
  kernel: GuestKernel,
  opts: { extra?: string[]; cpu?: string; facts: boolean; timings: boolean; verbose: boolean },
): Promise<BootReport & { facts?: GuestFacts; warnings: string[] }> {
  const warnings: string[] = [];
  const vm = await bootRootfs({
    image,
    agentLayer,
    kernel,
    extraCmdline: opts.extra,
    ...(opts.cpu ? { cpu: opts.cpu } : {}),
    onConsole: (l) => {
      if (l.startsWith("HUTCH_WARN")) warnings.push(l);
      if (opts.verbose) process.stderr.write(`  | ${l}\n`);
    },
  });
  try {
    const { client, helloMs, agentPid } = await connect(vm);
    try {
      // Timings first: "right after boot" is the point.
      const python = opts.timings ? await timeTwice(client, "python3 -c 'import json,unittest'") : undefined;
      const node = opts.timings ? await timeTwice(client, "node -e 0") : undefined;
      const facts = opts.facts ? await gatherFacts(client, agentPid) : undefined;
      return { readyMs: vm.readyMs, readyUptime: vm.readyUptime, helloMs, python, node, facts, warnings };
    } finally {
      client.close();
    }
  } finally {
    await vm.kill();
  }
}

async function main(argv: string[]): Promise<number> {
  const json = argv.includes("--json");
  const verbose = argv.includes("--verbose");
  const bootsArg = argv.indexOf("--boots");
  const boots = bootsArg >= 0 ? Number(argv[bootsArg + 1]) : 1;
  if (!Number.isInteger(boots) || boots < 1) throw new Error("--boots expects a positive integer");
  const appendArg = argv.indexOf("--append");
  const append = appendArg >= 0 ? (argv[appendArg + 1] ?? "").split(/\s+/).filter(Boolean) : [];
  const cpuArg = argv.indexOf("--cpu");
  const cpu = cpuArg >= 0 ? argv[cpuArg + 1] : undefined;
  const log = (m: string) => process.stderr.write(`[verify] ${m}\n`);

  const rootfs = await ensureRootfs();
  const layer = await ensureAgentLayer();
  const kernel = await findGuestKernel(log);
  log(`image ${rootfs.image} (${fmtBytes(rootfs.sizeBytes)}), kernel: ${kernel.description}, accel: tcg`);

  const runs: (BootReport & { facts?: GuestFacts; warnings: string[] })[] = [];
  for (let i = 0; i < boots; i++) {
    const r = await oneBoot(rootfs.image, layer.image, kernel, { extra: append, cpu, facts: i === 0, timings: true, verbose });
    log(`boot ${i + 1}/${boots}: HUTCH_READY after ${(r.readyMs / 1000).toFixed(2)} s wall (guest uptime ${r.readyUptime} s), hello ${r.helloMs.toFixed(0)} ms`);
    runs.push(r);
  }
  let noPreload: BootReport | undefined;
  if (argv.includes("--compare-preload")) {
    noPreload = await oneBoot(rootfs.image, layer.image, kernel, { extra: [...append, "hutch.preload=0"], cpu, facts: false, timings: true, verbose });
    log(`boot with hutch.preload=0: HUTCH_READY after ${(noPreload.readyMs / 1000).toFixed(2)} s`);
  }
  const first = runs[0];
  if (!first) throw new Error("no boot ran");
  const summary = {
    image: rootfs.image,
    imageHash: rootfs.hash,
    kernel: kernel.description,
    kernelFlavor: kernel.flavor,
    accel: "tcg",
    boots,
    append,
    cpu: cpu ?? "default",
    readyMsMedian: median(runs.map((r) => r.readyMs)),
    readyMs: runs.map((r) => Math.round(r.readyMs)),
    readyUptime: runs.map((r) => r.readyUptime),
    helloMs: runs.map((r) => Math.round(r.helloMs)),
    pythonImportJsonUnittest: runs.map((r) => r.python),
    nodeE0: runs.map((r) => r.node),
    noPreload: noPreload ? { readyMs: Math.round(noPreload.readyMs), python: noPreload.python, node: noPreload.node } : undefined,
    warnings: first.warnings,
    facts: first.facts,
  };
  if (json) process.stdout.write(`${JSON.stringify(summary)}\n`);
  else process.stdout.write(`${JSON.stringify(summary, null, 2)}\n`);
  return 0;
}

runIfMain(import.meta.url, "verify", main);
