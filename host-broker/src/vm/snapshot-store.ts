import { pidAlive } from '../../../build/cache.ts';
import { createHash } from 'node:crypto';
import { existsSync, mkdirSync, readdirSync, readFileSync, renameSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { execFileSync } from 'node:child_process';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { join } from 'node:path';
import { tmpdir } from 'node:os';
import { performance } from 'node:perf_hooks';
import type { Logger } from '../../../guest-agent/src/log.ts';
import { connectAgent, detachAgent } from './agent-channel.ts';
import type { GuestImage, SnapshotFiles, VmmDriver } from './vmm.ts';

export interface PristineMeta {
  key: string;
  memoryMiB: number;
  cpus: number;
  swapMiB: number;
  accel: string;
  bootMs: number;
  snapshotMs: number;
  stateBytes: number;
  createdAt: string;
}

export interface Pristine extends SnapshotFiles {
  meta: PristineMeta;
  dir: string;
}

/**
 * Bumped when the VM's device layout changes (a snapshot only restores into the same
 * layout), or when snapshots made before a fix cannot be trusted: 2 = memory files written
 * before restored VMs ran under the shared-RAM guard may have holes punched in them;
 * 3 = snapshots taken with the agent detached (epoch handshake); 4 = the state file's
 * writer is waited for (before, a busy host could leave it truncated); 5 = the agent layer
 * is the first disk, the template's root the second, swap the third (templates).
 */
const LAYOUT_VERSION = 5;

/**
 * The pristine snapshot: one VM booted to a warm, ready agent, paused, its RAM kept in a
 * file and its device state in another. Every tenant VM is restored from it. Cached under
 * ~/.cache/hutch/snapshots/<key>/ by the hash of everything that shapes it (kernel,
 * rootfs with the agent in it, VM size, accelerator, QEMU version, device layout).
 */
export class SnapshotStore {
  private readonly building = new Map<string, Promise<Pristine>>();

  constructor(
    private readonly cacheDir: string,
    private readonly driver: VmmDriver,
    private readonly log: Logger,
  ) {
    this.removeAbandoned();
  }

  /** Half-built snapshots of processes that died (`<key>.tmp-<pid>`) are garbage. */
  private removeAbandoned(): void {
    const root = join(this.cacheDir, 'snapshots');
    let names: string[] = [];
    try {
      names = readdirSync(root);
    } catch {
      return;
    }
    for (const n of names) {
      const m = /\.tmp-(\d+)$/.exec(n);
      if (m && !pidAlive(Number(m[1]))) {
        rmSync(join(root, n), { recursive: true, force: true });
        this.log.info('snapshot.abandoned_removed', { dir: n });
      }
    }
  }

  key(image: GuestImage & { key: string }, size: { memoryMiB: number; cpus: number; swapMiB: number }): string {
    return createHash('sha256')
      .update(JSON.stringify([LAYOUT_VERSION, image.key, image.flavor, image.cmdline ?? [], size, this.driver.name, this.driver.accel, qemuVersion()]))
      .digest('hex')
      .slice(0, 24);
  }

  async pristine(image: GuestImage & { key: string }, size: { memoryMiB: number; cpus: number; swapMiB: number }): Promise<Pristine> {
    const key = this.key(image, size);
    const dir = join(this.cacheDir, 'snapshots', key);
    const cached = this.read(dir);
    if (cached) return cached;
    let p = this.building.get(key);
    if (!p) {
      p = this.build(key, dir, image, size).finally(() => this.building.delete(key));
      this.building.set(key, p);
    }
    return p;
  }

  private read(dir: string): Pristine | undefined {
    const metaPath = join(dir, 'meta.json');
    if (!existsSync(metaPath)) return undefined;
    try {
      const meta = JSON.parse(readFileSync(metaPath, 'utf8')) as PristineMeta;
      const memory = join(dir, 'memory.img');
      const state = join(dir, 'state.bin');
      if (!existsSync(memory) || !existsSync(state) || statSync(memory).size !== meta.memoryMiB * 1024 * 1024) return undefined;
      if (statSync(state).size !== meta.stateBytes) return undefined; // torn: rebuild rather than fail every restore
      return { meta, dir, memory, state };
    } catch {
      return undefined;
    }
  }

  private async build(key: string, dir: string, image: GuestImage, size: { memoryMiB: number; cpus: number; swapMiB: number }): Promise<Pristine> {
    const lock = `${dir}.lock`;
    mkdirSync(join(this.cacheDir, 'snapshots'), { recursive: true });
    await acquireLock(lock, () => this.read(dir) !== undefined);
    try {
      const again = this.read(dir);
      if (again) return again;
      rmSync(dir, { recursive: true, force: true });
      const tmp = `${dir}.tmp-${process.pid}`;
      rmSync(tmp, { recursive: true, force: true });
      mkdirSync(tmp, { recursive: true });
      this.log.info('snapshot.pristine_build', { key, memoryMiB: size.memoryMiB, cpus: size.cpus, accel: this.driver.accel });
      const t0 = performance.now();
      // The VM's sockets live in a short runtime dir: a Unix socket path has at most 107
      // bytes, and a template's snapshot dir can be deep under any data dir.
      const vmDir = join(tmpdir(), `hutch-pristine-${key.slice(0, 8)}-${process.pid}`);
      const vm = await this.driver.boot(
        { id: `pristine-${key.slice(0, 8)}`, dir: vmDir, image, memoryMiB: size.memoryMiB, cpus: size.cpus, swapMiB: size.swapMiB },
        { file: join(tmp, 'memory.img'), shared: true },
      );
      try {
        const agent = await connectAgent(vm, { timeoutMs: Number(process.env.HUTCH_BOOT_TIMEOUT_MS ?? 300_000), log: this.log });
        const bootMs = performance.now() - t0;
        // The agent answered: init is done (python preloaded, caches warm). Nothing runs now.
        await agent.call('ping', {}, { timeoutMs: 60_000 });
        // Every restore gets an empty swap disk: a page swapped out now would read back as zeros in all of them.
        const mem = (await agent.call('telemetry.sample', {}, { timeoutMs: 60_000 })).memory;
        if (mem.swapUsedBytes > 0) {
          throw new HutchError('unavailable', `the guest swapped ${mem.swapUsedBytes} bytes while it booted for the pristine snapshot (${size.memoryMiB} MiB); a snapshot of it would lose them: give the sandbox more memory`, { memoryMiB: size.memoryMiB });
        }
        // Snapshot with no broker session in the guest: every restore then starts from an
        // agent waiting for its first broker, whoever built the snapshot.
        await detachAgent(agent);
        await new Promise((r) => setTimeout(r, 400));
        const snap = await vm.snapshot(join(tmp, 'state.bin'));
        await vm.destroy();
        const meta: PristineMeta = { key, ...size, accel: this.driver.accel, bootMs: Math.round(bootMs), snapshotMs: Math.round(snap.ms), stateBytes: snap.stateBytes, createdAt: new Date().toISOString() };
        writeFileSync(join(tmp, 'meta.json'), JSON.stringify(meta, null, 2));
        rmSync(vmDir, { recursive: true, force: true });
        renameSync(tmp, dir);
        this.log.info('snapshot.pristine_ready', { ...meta });
        return { meta, dir, memory: join(dir, 'memory.img'), state: join(dir, 'state.bin') };
      } catch (err) {
        await vm.destroy();
        rmSync(tmp, { recursive: true, force: true });
        throw err;
      }
    } finally {
      rmSync(lock, { recursive: true, force: true });
    }
  }
}

let qemuVersionCache: string | undefined;
function qemuVersion(): string {
  qemuVersionCache ??= execFileSync('qemu-system-x86_64', ['--version'], { encoding: 'utf8' }).split('\n')[0] ?? 'unknown';
  return qemuVersionCache;
}

/** A directory lock shared by processes (another broker, a test run) building the same snapshot. */
async function acquireLock(lock: string, done: () => boolean, staleMs = 15 * 60_000): Promise<void> {
  for (;;) {
    try {
      mkdirSync(lock);
      writeFileSync(join(lock, 'pid'), String(process.pid));
      return;
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code !== 'EEXIST') throw err;
    }
    if (done()) return;
    let owner = 0;
    try {
      owner = Number(readFileSync(join(lock, 'pid'), 'utf8'));
    } catch {
      // being created
    }
    const age = Date.now() - (statSync(lock, { throwIfNoEntry: false })?.mtimeMs ?? Date.now());
    if ((owner > 0 && !pidAlive(owner)) || age > staleMs) {
      rmSync(lock, { recursive: true, force: true });
      continue;
    }
    await new Promise((r) => setTimeout(r, 500));
  }
}


