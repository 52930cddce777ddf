/**
 * `hutch setup` (a clone's first command: Debian packages, then the guest image) and
 * `hutch prepare` (the guest image alone: what a container's init step runs, its packages
 * being in the image). The guest image is the kernel, the agent layer, the default
 * template's root filesystem and its pristine snapshot, each cached under HUTCH_CACHE by
 * the hash of its inputs: minutes on a fresh machine, a second when nothing changed.
 */
import { Command, int, logLevel, oneOf, type OptionSpec } from '../../../guest-agent/src/cli-options.ts';
import type { LogLevel } from '../../../guest-agent/src/log.ts';
import { defaultLogFormat, SetupProgress, type LogFormat } from './progress.ts';

const OPTIONS = {
  'log-format': { arg: 'F', help: 'human | json (default: human on a terminal, json lines elsewhere)', parse: oneOf(['human', 'json'] as const) },
  'log-level': { arg: 'L', help: 'debug | info | warn | error (default info; env HUTCH_LOG_LEVEL)', env: 'HUTCH_LOG_LEVEL', parse: logLevel },
  kernel: { arg: 'K', help: "hutch | debian: the guest kernel (default hutch: hutch's own build)", parse: oneOf(['hutch', 'debian'] as const) },
  'memory-mib': { arg: 'N', help: "memory of the pristine snapshot's VM, MiB (default 512, what a session gets)", default: '512', parse: int(64, 65536) },
  cpus: { arg: 'N', help: "vCPUs of the pristine snapshot's VM (default 1)", default: '1', parse: int(1, 64) },
} satisfies Record<string, OptionSpec>;

export const SETUP = new Command({
  name: 'hutch setup',
  summary: 'Install the Debian packages hutch uses, then build (or find cached) the guest image: kernel, agent layer,\nroot filesystem and pristine snapshot. Idempotent; HUTCH_SKIP_GUEST=1 stops after the packages.',
  options: OPTIONS,
  footer: 'The npm packages come first (./hutch runs npm ci when package-lock.json changed). Cache: $HUTCH_CACHE,\nelse ~/.cache/hutch.',
});

export const PREPARE = new Command({
  name: 'hutch prepare',
  summary: "Build (or find cached) the guest image alone: what a container's init step runs (its packages are in\nthe image), so the broker can start with --no-build.",
  options: OPTIONS,
});

export interface SetupPlan {
  packages: boolean;
  guest: boolean;
  format: LogFormat;
  level: LogLevel;
  kernel?: 'hutch' | 'debian' | undefined;
  size: { memoryMiB: number; cpus: number };
}

/** Runs the plan's steps with progress for a person (or JSON log lines), ending in one summary line. */
export async function runSetup(plan: SetupPlan): Promise<void> {
  const progress = new SetupProgress({ format: plan.format, level: plan.level, name: 'hutch-setup' });
  const done: string[] = [];
  if (plan.packages) {
    const { installHostPackages } = await import('../../../build/host-packages.ts');
    const r = await progress.run('Debian packages', () => installHostPackages((m) => progress.log.info('setup.packages', { detail: m })), (r) => (r.installed.length ? `installed ${r.installed.join(' ')}` : 'all present'));
    done.push(r.installed.length ? `${r.installed.length} Debian packages installed` : 'Debian packages present');
  }
  if (!plan.guest) {
    progress.summary(`ready: ${[...done, 'no guest image (HUTCH_SKIP_GUEST=1)'].join(', ')}`, { guest: false });
    return;
  }
  const [{ QemuBackend }, { cacheDir }, { join }] = await Promise.all([import('../backends/qemu-backend.ts'), import('../backends/registry.ts'), import('node:path')]);
  const backend = await progress.run(
    'guest image',
    () => QemuBackend.create({ dataDir: join(cacheDir(), 'prepare'), cacheDir: cacheDir(), log: progress.log, ...(plan.kernel ? { kernel: plan.kernel } : {}) }),
    (b) => (b.image.built.kernelSeconds + b.image.built.rootfsSeconds > 0 ? 'built' : 'cached'),
  );
  try {
    await progress.run(`pristine snapshot (${plan.size.memoryMiB} MiB, ${plan.size.cpus} vCPU)`, () => backend.prepare(plan.size));
  } finally {
    await backend.shutdown();
  }
  const accel = backend.accel === 'kvm' ? 'VMs run under KVM' : 'VMs run under TCG, without KVM: slow (see the warning above)';
  progress.summary(`ready: ${[...done, backend.image.describe].join(', ')}; ${accel}`, { accel: backend.accel, accelReason: backend.accelReason, image: backend.image.describe });
}

function planFrom(v: { 'log-format'?: LogFormat | undefined; 'log-level'?: LogLevel | undefined; kernel?: 'hutch' | 'debian' | undefined; 'memory-mib': number; cpus: number }, packages: boolean): SetupPlan {
  return {
    packages,
    guest: process.env['HUTCH_SKIP_GUEST'] !== '1',
    format: v['log-format'] ?? defaultLogFormat(),
    level: v['log-level'] ?? 'info',
    kernel: v.kernel,
    size: { memoryMiB: v['memory-mib'], cpus: v.cpus },
  };
}

export async function setupMain(args: string[]): Promise<void> {
  const p = SETUP.parse(args);
  if (p) await runSetup(planFrom(p.values, true));
}

export async function prepareMain(args: string[]): Promise<void> {
  const p = PREPARE.parse(args);
  if (p) await runSetup({ ...planFrom(p.values, false), guest: true });
}
