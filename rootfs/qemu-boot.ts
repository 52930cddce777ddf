/**
 * Boot a rootfs image under QEMU microvm for verification (the rootfs test
 * and `rootfs/verify.ts`); not the VM manager, which lives in the broker.
 *
 * Waits for the init's `HUTCH_READY <uptime>` console line, exposes the
 * agent's virtio-serial port as a Unix socket, and always cleans up: QEMU runs
 * under `setpriv --pdeathsig KILL`, so it dies with this process even if that
 * is killed outright, and `kill()` SIGKILLs it and removes its files.
 */
import { spawn, type ChildProcess } from "node:child_process";
import { mkdtemp, readdir, readFile, rm, stat, truncate, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import path from "node:path";
import { cacheRoot, exists } from "../build/cache.ts";
import { kernelCmdline, microvmMachine, TCG_ACCEL_ARGS, type KernelFlavor } from "../kernel-configs/boot-params.ts";
import { ensureDebianKernel } from "../kernel-configs/debian-kernel.ts";

export interface GuestKernel {
  flavor: KernelFlavor;
  /** vmlinux (hutch, PVH entry) or vmlinuz (Debian). */
  kernel: string;
  initrd?: string;
  /** Human-readable origin, for reports. */
  description: string;
}

/** The virtio-serial port name the agent listens on (init's default hutch.listen). */
export const AGENT_PORT_NAME = "hutch-agent";

/**
 * The guest kernel to boot: $HUTCH_GUEST_KERNEL (`hutch`, `debian` or a
 * vmlinux path), else the newest hutch kernel in the cache, else Debian's
 * kernel + initramfs (kernel-configs/debian-kernel.ts). The hutch kernel is
 * not built here: that takes minutes (`npx tsx kernel-configs/build.ts`).
 */
export async function findGuestKernel(log?: (m: string) => void): Promise<GuestKernel> {
  const want = process.env["HUTCH_GUEST_KERNEL"] ?? "";
  if (want !== "" && want !== "hutch" && want !== "debian") {
    if (!(await exists(want))) throw new Error(`HUTCH_GUEST_KERNEL=${want}: no such file`);
    return { flavor: "hutch", kernel: want, description: `hutch kernel ${want} (HUTCH_GUEST_KERNEL)` };
  }
  if (want !== "debian") {
    const root = path.join(cacheRoot(), "kernel");
    const candidates: { vmlinux: string; mtime: number; hash: string }[] = [];
    for (const hash of (await exists(root)) ? await readdir(root) : []) {
      const vmlinux = path.join(root, hash, "vmlinux");
      if ((await exists(vmlinux)) && (await exists(path.join(root, hash, "build.json")))) {
        candidates.push({ vmlinux, mtime: (await stat(vmlinux)).mtimeMs, hash });
      }
    }
    candidates.sort((a, b) => b.mtime - a.mtime);
    const newest = candidates[0];
    if (newest) return { flavor: "hutch", kernel: newest.vmlinux, description: `hutch kernel ${newest.hash} (${newest.vmlinux})` };
    if (want === "hutch") throw new Error(`HUTCH_GUEST_KERNEL=hutch but ${root} has no built kernel; run: npx tsx kernel-configs/build.ts`);
  }
  const d = await ensureDebianKernel({ log });
  return { flavor: "debian", kernel: d.vmlinuz, initrd: d.initrd, description: `Debian ${d.kernelRelease} + initramfs (fallback, ${d.dir})` };
}

/**
 * The host's TSC frequency in kHz, from /proc/cpuinfo, when the host says its
 * TSC is constant (constant_tsc): under TCG the guest's TSC is the host's.
 */
export async function hostTscKhz(): Promise<number | undefined> {
  const info = await readFile("/proc/cpuinfo", "utf8");
  const flags = /^flags\s*:\s*(.*)$/m.exec(info)?.[1]?.split(/\s+/) ?? [];
  const mhz = Number(/^cpu MHz\s*:\s*([\d.]+)$/m.exec(info)?.[1]);
  if (!flags.includes("constant_tsc") || !Number.isFinite(mhz) || mhz <= 0) return undefined;
  return Math.round(mhz * 1000);
}

/**
 * Workaround for cold boots hanging under TCG when the host CPU is busy (seen
 * here with the Debian kernel every time while two other builds ran): the
 * kernel fails to calibrate the TSC against the PIT ("tsc: Unable to calibrate
 * against PIT ... Marking TSC unstable") and then stalls. Telling it the TSC
 * frequency skips the calibration. Belongs in kernel-configs/boot-params.ts
 * (TCG_CMDLINE) once its owner confirms it; kept here so rootfs tests boot.
 */
export async function tscCmdline(): Promise<string[]> {
  const khz = await hostTscKhz();
  return khz === undefined ? [] : [`tsc_early_khz=${khz}`, "tsc=reliable"];
}

export interface BootOptions {
  /** The template's root filesystem (second disk). */
  image: string;
  /** The agent layer (first disk, the kernel's root: its init mounts `image`). */
  agentLayer: string;
  kernel: GuestKernel;
  memMiB?: number;
  smp?: number;
  /** QEMU -cpu model; default from boot-params.ts (TCG_ACCEL_ARGS). */
  cpu?: string;
  /** Size of the sparse swap disk attached as the second virtio-blk device; 0 for none. Default 256. */
  swapMiB?: number;
  /** hutch.* (or other) kernel parameters appended to the command line. */
  extraCmdline?: readonly string[];
  /** Give up (and kill QEMU) if HUTCH_READY has not appeared by then. Default 180 s. */
  readyTimeoutMs?: number;
  /** Every console line, as it arrives. */
  onConsole?: (line: string) => void;
}

export interface BootedVm {
  pid: number;
  /** Unix socket connected to the agent's virtio-serial port. */
  agentSocket: string;
  /** Wall ms from QEMU's spawn to the HUTCH_READY line. */
  readyMs: number;
  /** Guest uptime (s) printed with HUTCH_READY. */
  readyUptime: number;
  consoleLines: string[];
  cmdline: string;
  qemuArgs: string[];
  /** Resolves when QEMU exits. */
  exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
  /** SIGKILL QEMU (if alive), wait for it, remove the socket and swap file. Idempotent. */
  kill(): Promise<void>;
}

export class BootError extends Error {
  constructor(
    message: string,
    readonly consoleTail: string[],
  ) {
    super(`${message}\n--- console tail ---\n${consoleTail.join("\n")}`);
    this.name = "BootError";
  }
}

function buildArgs(opts: BootOptions, sock: string, swapFile: string | undefined, cmdline: string): string[] {
  const smp = opts.smp ?? 1;
  const args = [
    "-M", microvmMachine({ smp, flavor: opts.kernel.flavor }),
    ...(opts.cpu ? ["-accel", "tcg", "-cpu", opts.cpu] : TCG_ACCEL_ARGS),
    "-m", String(opts.memMiB ?? 512),
    "-smp", String(smp),
    "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
    "-serial", "stdio",
    "-kernel", opts.kernel.kernel,
    "-append", cmdline,
  ];
  if (opts.kernel.initrd) args.push("-initrd", opts.kernel.initrd);
  // Device order decides the guest names: agent layer (/dev/vda, the kernel's root), the
  // template's root (/dev/vdb), swap (/dev/vdc), as in host-broker/src/vm/qemu-driver.ts.
  args.push("-drive", `id=layer,file=${opts.agentLayer},format=raw,if=none,readonly=on`, "-device", "virtio-blk-device,drive=layer");
  args.push("-drive", `id=root,file=${opts.image},format=raw,if=none,readonly=on`, "-device", "virtio-blk-device,drive=root");
  if (swapFile) args.push("-drive", `id=swap,file=${swapFile},format=raw,if=none`, "-device", "virtio-blk-device,drive=swap");
  args.push(
    "-device", "virtio-serial-device",
    "-chardev", `socket,id=agent,path=${sock},server=on,wait=off`,
    "-device", `virtserialport,chardev=agent,name=${AGENT_PORT_NAME}`,
    // Entropy from the host: Node and Python read getrandom() at startup.
    "-device", "virtio-rng-device",
  );
  return args;
}

/** Boots the image and resolves once the guest printed HUTCH_READY; rejects (QEMU killed) otherwise. */
export async function bootRootfs(opts: BootOptions): Promise<BootedVm> {
  const work = await mkdtemp(path.join(tmpdir(), "hutch-boot-"));
  const sock = path.join(work, "agent.sock");
  let swapFile: string | undefined;
  if ((opts.swapMiB ?? 256) > 0) {
    swapFile = path.join(work, "swap.img");
    await writeFile(swapFile, "");
    await truncate(swapFile, (opts.swapMiB ?? 256) * 1024 * 1024);
  }
  const base = kernelCmdline({ flavor: opts.kernel.flavor, extra: ["init=/sbin/init"] });
  // Once boot-params.ts carries the TSC workaround itself, do not add it twice.
  const tsc = /\btsc_early_khz=/.test(base) ? [] : await tscCmdline();
  const cmdline = [base, ...tsc, ...(opts.extraCmdline ?? [])].join(" ");
  const qemuArgs = buildArgs(opts, sock, swapFile, cmdline);

  const started = performance.now();
  const child: ChildProcess = spawn("setpriv", ["--pdeathsig", "KILL", "--", "qemu-system-x86_64", ...qemuArgs], {
    stdio: ["ignore", "pipe", "pipe"],
  });
  const consoleLines: string[] = [];
  let stderr = "";
  const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) => {
    child.once("close", (code, signal) => resolve({ code, signal }));
  });
  let cleaned = false;
  const kill = async (): Promise<void> => {
    if (child.exitCode === null && child.signalCode === null) child.kill("SIGKILL");
    await exited;
    if (!cleaned) {
      cleaned = true;
      await rm(work, { recursive: true, force: true });
    }
  };

  const ready = new Promise<{ readyMs: number; uptime: number }>((resolve, reject) => {
    let pending = "";
    const timer = setTimeout(() => {
      reject(new BootError(`no HUTCH_READY within ${(opts.readyTimeoutMs ?? 180_000) / 1000} s`, consoleLines.slice(-40)));
    }, opts.readyTimeoutMs ?? 180_000);
    child.stdout?.setEncoding("utf8").on("data", (d: string) => {
      pending += d;
      let nl: number;
      while ((nl = pending.indexOf("\n")) >= 0) {
        const line = pending.slice(0, nl).replace(/\r$/, "");
        pending = pending.slice(nl + 1);
        consoleLines.push(line);
        opts.onConsole?.(line);
        const m = /^HUTCH_READY ([\d.]+)/.exec(line);
        if (m) {
          clearTimeout(timer);
          resolve({ readyMs: performance.now() - started, uptime: Number(m[1]) });
        } else if (line.startsWith("HUTCH_FAILED")) {
          clearTimeout(timer);
          reject(new BootError(`guest init failed: ${line}`, consoleLines.slice(-40)));
        }
      }
    });
    child.stderr?.setEncoding("utf8").on("data", (d: string) => {
      stderr += d;
    });
    child.once("error", (err) => {
      clearTimeout(timer);
      reject(new BootError(`cannot start QEMU: ${err.message}`, []));
    });
    void exited.then(({ code, signal }) => {
      clearTimeout(timer);
      reject(new BootError(`QEMU exited (${signal ?? `code ${code}`}) before HUTCH_READY${stderr ? `: ${stderr.trim().slice(-500)}` : ""}`, consoleLines.slice(-40)));
    });
  });

  try {
    const r = await ready;
    return {
      pid: child.pid ?? -1,
      agentSocket: sock,
      readyMs: r.readyMs,
      readyUptime: r.uptime,
      consoleLines,
      cmdline,
      qemuArgs,
      exited,
      kill,
    };
  } catch (err) {
    await kill();
    throw err;
  }
}
