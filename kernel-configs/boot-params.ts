import { readFile } from "node:fs/promises";
import { capture } from "../build/run.ts";

/**
 * How to boot hutch's guest kernels under QEMU microvm: the machine options and
 * kernel command line measured to boot reliably here (see README.md, "Boot
 * reliability"). The VM driver imports these instead of hard-coding flags, so
 * a finding about boot reliability changes one file.
 */

/** Which kernel is booted: hutch's own (vmlinux, PVH, no initramfs) or Debian's fallback (bzImage + initramfs). */
export type KernelFlavor = "hutch" | "debian";

export interface MachineOptions {
  /** vCPUs; decides whether the legacy PIT/PIC are needed (see below). */
  smp: number;
  flavor: KernelFlavor;
}

/**
 * `-M` value for QEMU's microvm machine.
 *
 * - acpi=off for hutch's kernel: it has no ACPI; QEMU then lists the
 *   virtio-mmio devices on the kernel command line (auto-kernel-cmdline),
 *   the MP table describes CPUs and IRQs, and qboot (faster than SeaBIOS)
 *   loads the kernel. Debian's kernel lacks VIRTIO_MMIO_CMDLINE_DEVICES, so it
 *   keeps ACPI (the default) to find its disks.
 * - pit=on,pic=on (QEMU's default for microvm, spelled out because it is
 *   load-bearing): under TCG there is no kvmclock and no HPET, and the PIT is
 *   the only tick before the LAPIC timer is verified against it. With
 *   pit=off,pic=off every boot hung ("APIC timer disabled due to
 *   verification failure", then no clock at all) even with tsc_early_khz=.
 * - rtc=on: wall-clock time at boot comes from the CMOS RTC (no kvmclock under TCG).
 */
export function microvmMachine(opts: MachineOptions): string {
  const parts = ["microvm"];
  if (opts.flavor === "hutch") parts.push("acpi=off");
  parts.push("pit=on", "pic=on", "rtc=on");
  return parts.join(",");
}

/** Accelerator and CPU model when no working KVM is available (this host). */
export const TCG_ACCEL_ARGS: readonly string[] = ["-accel", "tcg", "-cpu", "max"];

/**
 * Kernel command-line pieces every hutch guest gets, and why:
 * - console=ttyS0: boot messages on the ISA serial port.
 * - reboot=t + QEMU -no-reboot: `reboot -f` in the guest triple-faults and
 *   QEMU exits, the only clean exit without ACPI.
 * - panic=-1: a panic reboots at once, so the VMM sees the guest die
 *   instead of a hung VM.
 * - quiet: serial output is emulated byte by byte; printing the boot log costs boot time.
 */
export const BASE_CMDLINE: readonly string[] = ["console=ttyS0", "reboot=t", "panic=-1", "quiet"];

/**
 * Pieces for TCG (no KVM, so no kvmclock to tell the guest its TSC rate).
 *
 * Under TCG the guest's TSC is the host's TSC. Calibrating it against the
 * emulated PIT fails whenever the host preempts QEMU's vCPU thread during the
 * calibration loop (a busy host: other VMs, builds). The kernel then marks the
 * TSC unstable and times everything with jiffies; Debian's kernel (ACPI
 * microvm) hangs at that point waiting for timer ticks that never arrive.
 * tsc_early_khz= skips calibration altogether (the delay loop and the LAPIC
 * timer then calibrate from the TSC too), and tsc=reliable skips the TSC
 * watchdog and the cross-CPU sync check, both of which misfire under TCG's
 * jittery timing.
 *
 * no_timer_check: the IO-APIC setup checks that 5 timer ticks arrive within
 * ~76 ms of TSC time; a preempted TCG vCPU misses that window and the kernel
 * panics ("IO-APIC + timer doesn't work!"): without panic= that panic looks
 * exactly like a hung boot.
 */
export function tcgCmdline(tscKhz: number): string[] {
  if (!Number.isInteger(tscKhz) || tscKhz < 100_000 || tscKhz > 10_000_000) {
    throw new RangeError(`implausible TSC frequency ${tscKhz} kHz`);
  }
  return [`tsc_early_khz=${tscKhz}`, "tsc=reliable", "no_timer_check"];
}

/** Pieces only Debian's kernel needs: its zswap is built in but off by default. */
export const DEBIAN_CMDLINE: readonly string[] = ["zswap.enabled=1"];

export interface CmdlineOptions {
  flavor: KernelFlavor;
  /** Root device; default /dev/vda (the first virtio-blk device). */
  root?: string;
  /** Mount the root read-only (the hutch rootfs is read-only); default true. */
  readOnly?: boolean;
  /** Host TSC frequency (hostTscKhz()) when running under TCG; omit under KVM. */
  tcgTscKhz?: number;
  /** Appended last, so it can override anything above. */
  extra?: readonly string[];
}

/** The full kernel command line for a hutch guest. */
export function kernelCmdline(opts: CmdlineOptions): string {
  const parts = [...BASE_CMDLINE, `root=${opts.root ?? "/dev/vda"}`, opts.readOnly === false ? "rw" : "ro"];
  if (opts.flavor === "hutch") parts.push("rootfstype=ext4");
  if (opts.flavor === "debian") parts.push(...DEBIAN_CMDLINE);
  if (opts.tcgTscKhz !== undefined) parts.push(...tcgCmdline(opts.tcgTscKhz));
  parts.push(...(opts.extra ?? []));
  return parts.join(" ");
}

export interface HostTscFrequency {
  khz: number;
  /** Where the number came from; "cpuinfo-estimate" may be off by a few percent on hosts with frequency scaling. */
  source: "cpuinfo-known-freq" | "dmesg" | "cpuinfo-estimate";
}

/**
 * The host's TSC frequency in kHz. Under TCG the guest's TSC is the host's
 * TSC (QEMU returns the host's rdtsc), so passing this as tsc_early_khz= lets
 * the guest skip TSC calibration, the step that hangs or fails when the host
 * is busy (see README.md).
 */
export async function hostTscKhz(): Promise<HostTscFrequency> {
  const cpuinfo = await readFile("/proc/cpuinfo", "utf8");
  const first = cpuinfo.split("\n\n")[0] ?? "";
  const mhz = Number(/^cpu MHz\s*:\s*([\d.]+)/m.exec(first)?.[1]);
  const flags = /^flags\s*:\s*(.*)$/m.exec(first)?.[1]?.split(/\s+/) ?? [];
  // tsc_known_freq: the host kernel took the frequency from CPUID or its
  // hypervisor, and "cpu MHz" then reports exactly that frequency.
  if (flags.includes("tsc_known_freq") && Number.isFinite(mhz) && mhz > 0) {
    return { khz: Math.round(mhz * 1000), source: "cpuinfo-known-freq" };
  }
  try {
    const log = await capture(["dmesg"]);
    const m =
      /tsc: Refined TSC clocksource calibration: ([\d.]+) MHz/.exec(log) ??
      /tsc: Detected ([\d.]+) MHz TSC/.exec(log) ??
      /tsc: Detected ([\d.]+) MHz processor/.exec(log);
    if (m) return { khz: Math.round(Number(m[1]) * 1000), source: "dmesg" };
  } catch {
    // dmesg may be restricted (kernel.dmesg_restrict) or its ring buffer rotated.
  }
  if (Number.isFinite(mhz) && mhz > 0) return { khz: Math.round(mhz * 1000), source: "cpuinfo-estimate" };
  throw new Error("cannot determine the host TSC frequency (no 'cpu MHz' in /proc/cpuinfo, no tsc line in dmesg)");
}
