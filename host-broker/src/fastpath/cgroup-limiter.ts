/**
 * Per-run cgroups (v2, or v1's pids + memory hierarchies) below the broker's own cgroup:
 *
 *   <own cgroup>/hutch-fastpath/pool-<broker pid>-<n>                 all runs: pids.max, memory limit
 *   <own cgroup>/hutch-fastpath/pool-<broker pid>-<n>/slot-<pid>-<m>  one run: pids.max, memory limit
 *
 * A slot bounds one run (maxProcesses, memoryBytes); the pool bounds every run of this fast
 * path together (totalProcesses, totalMemoryBytes), so however many run at once they cannot
 * take more of the host than that: past it the kernel reclaims and then OOM-kills inside
 * the pool, never outside it. (On v1 a pool holds its children only with hierarchical
 * accounting, `memory.use_hierarchy`; where that cannot be had, describe() says the total
 * does not hold.) A pool is this limiter's alone, so several brokers or fast paths in one
 * cgroup each keep their own total.
 *
 * A run enters its slot before bwrap starts, so the sandbox is inside before it can fork
 * (Node cannot spawn with CLONE_INTO_CGROUP): on v1 the spawn helper forks from inside it
 * (thread-cgroup.ts); otherwise a tiny `sh` step moves itself in and then execs bwrap. Slots are reused rather than made and removed per
 * run: mkdir/rmdir of a memory cgroup per call costs time, and a removed memcg that still
 * has page cache charged lingers as a "dying" cgroup until that cache is reclaimed.
 * Counters (OOM kills, refused forks) are read as deltas around each run.
 */
import { existsSync, mkdirSync, readdirSync, readFileSync, rmdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { ownDir, readCgroupLayout } from './cgroup-detect.ts';
import type { LimitDescription, Limiter, LimiterOptions, RunLimitReport, RunSlot } from './limits.ts';
import { pidAlive } from '../../../build/cache.ts';

type Version = 'cgroup-v1' | 'cgroup-v2';
type Controller = 'pids' | 'memory';

/** One hierarchy the slots live in: v2 has one holding both controllers; v1 one per controller (or one co-mounted). */
interface Hierarchy {
  mountPoint: string;
  /** The broker's own cgroup (or the configured delegated one). */
  base: string;
  /** base/hutch-fastpath: shared by every fast path in this cgroup. */
  parent: string;
  /** parent/pool-<pid>-<n>: this limiter's, where its slots are made. */
  pool: string;
  controllers: Controller[];
}

interface Slot {
  name: string;
  dirs: Array<{ dir: string; controllers: Controller[] }>;
}

interface Counters {
  oomKills: number;
  pidsMax: number;
}

const PARENT_NAME = 'hutch-fastpath';
const MAX_FREE_SLOTS = 16;
const DRAIN_TIMEOUT_MS = 2000;
/** Slot and pool names are unique per process, not per limiter: tests and benches run several fast paths at once. */
let slotCounter = 0;
let poolCounter = 0;

export type CgroupProbe = { limiter: CgroupLimiter } | { unavailable: string; error: HutchError };

export function probeCgroupLimiter(version: Version, opts: LimiterOptions): CgroupProbe {
  const no = (why: string): CgroupProbe => ({ unavailable: why, error: new HutchError('unavailable', `${version} limits unavailable: ${why}`) });
  let layout;
  try {
    layout = readCgroupLayout();
  } catch (err) {
    return no(`cannot read /proc/self cgroup files (${(err as Error).message})`);
  }
  if (version === 'cgroup-v2') {
    const mount = layout.mounts.find((m) => m.fstype === 'cgroup2');
    if (!mount) return no('no cgroup2 file system mounted');
    const base = opts.cgroupParent ?? ownDir(layout, mount);
    if (base === undefined) return no('this process has no cgroup2 path');
    const available = readWords(join(base, 'cgroup.controllers'));
    const missing = (['pids', 'memory'] as const).filter((c) => !available.includes(c));
    if (missing.length > 0) return no(`${base} offers no ${missing.join(' or ')} controller (cgroup.controllers: "${available.join(' ')}")`);
    return { limiter: new CgroupLimiter(version, [hierarchy(mount.mountPoint, base, ['pids', 'memory'], poolName())], opts) };
  }
  const hierarchies: Hierarchy[] = [];
  const pool = poolName();
  for (const c of ['pids', 'memory'] as const) {
    const mount = layout.mounts.find((m) => m.fstype === 'cgroup' && m.controllers.includes(c));
    if (!mount) return no(`no v1 hierarchy with the ${c} controller is mounted`);
    const existing = hierarchies.find((h) => h.mountPoint === mount.mountPoint); // co-mounted controllers
    if (existing) {
      existing.controllers.push(c);
      continue;
    }
    const base = ownDir(layout, mount);
    if (base === undefined) return no(`this process has no path in the ${c} hierarchy`);
    hierarchies.push(hierarchy(mount.mountPoint, base, [c], pool));
  }
  return { limiter: new CgroupLimiter(version, hierarchies, opts) };
}

function poolName(): string {
  return `pool-${process.pid}-${poolCounter++}`;
}

function hierarchy(mountPoint: string, base: string, controllers: Controller[], pool: string): Hierarchy {
  const parent = join(base, PARENT_NAME);
  return { mountPoint, base, parent, pool: join(parent, pool), controllers };
}

export class CgroupLimiter implements Limiter {
  private readonly free: Slot[] = [];
  private readonly busy = new Set<Slot>();
  private closed = false;
  private notes: string[] = [];
  private totalHolds = false;

  constructor(
    readonly version: Version,
    private readonly hierarchies: Hierarchy[],
    private readonly opts: LimiterOptions,
  ) {}

  /** Makes the parents and the pool (enabling v2 controllers on the way), sweeps what dead brokers left, proves one slot works. */
  async init(notes: string[]): Promise<void> {
    this.notes = notes;
    for (const h of this.hierarchies) {
      if (this.version === 'cgroup-v2') enableControllers(h.base, h.controllers);
      this.ensurePool(h);
      this.sweepStale(h.parent);
    }
    this.totalHolds = this.poolHoldsChildren();
    if (!this.totalHolds) this.notes.push(`${this.version}: the pool's memory.use_hierarchy is off and cannot be set, so the total memory of all runs is not bounded by the kernel`);
    this.free.push(this.createSlot());
  }

  /**
   * The shared parent may vanish under us before our pool exists in it (another broker in
   * the same cgroup removes it when it closes and finds it empty); made again, with the
   * pool and its totals, before each new slot.
   */
  private ensurePool(h: Hierarchy): void {
    mkdirSync(h.parent, { recursive: true });
    if (this.version === 'cgroup-v2') enableControllers(h.parent, h.controllers);
    if (existsSync(h.pool)) return;
    mkdirSync(h.pool);
    if (this.version === 'cgroup-v2') enableControllers(h.pool, h.controllers);
    const { totalProcesses, totalMemoryBytes } = this.opts;
    const dir = (c: Controller) => (h.controllers.includes(c) ? h.pool : undefined);
    const pids = dir('pids');
    if (pids) writeFileSync(join(pids, 'pids.max'), String(totalProcesses));
    const memory = dir('memory');
    if (!memory) return;
    if (this.version === 'cgroup-v2') {
      writeFileSync(join(memory, 'memory.max'), String(totalMemoryBytes));
      tryWriteFile(join(memory, 'memory.swap.max'), '0');
    } else {
      // Before any child exists: only then may hierarchical accounting be switched on.
      tryWriteFile(join(memory, 'memory.use_hierarchy'), '1');
      writeFileSync(join(memory, 'memory.limit_in_bytes'), String(totalMemoryBytes));
      tryWriteFile(join(memory, 'memory.memsw.limit_in_bytes'), String(totalMemoryBytes));
    }
  }

  /** v1: whether the pool's limit covers its slots (v2 always does). */
  private poolHoldsChildren(): boolean {
    if (this.version === 'cgroup-v2') return true;
    const h = this.hierarchies.find((x) => x.controllers.includes('memory'));
    try {
      return h !== undefined && readFileSync(join(h.pool, 'memory.use_hierarchy'), 'utf8').trim() === '1';
    } catch {
      return false;
    }
  }

  describe(): LimitDescription {
    return {
      mechanism: this.version,
      maxProcesses: this.opts.maxProcesses,
      memoryBytes: this.opts.memoryBytes,
      totalProcesses: this.opts.totalProcesses,
      totalMemoryBytes: this.opts.totalMemoryBytes,
      processLimitEnforced: true,
      memoryScope: 'sandbox',
      totalEnforced: this.totalHolds,
      cgroupParents: this.hierarchies.map((h) => h.pool),
      notes: this.notes,
    };
  }

  async acquire(): Promise<RunSlot> {
    if (this.closed) throw new HutchError('unavailable', 'fast path limiter is closed');
    const slot = this.free.pop() ?? this.createSlot();
    this.busy.add(slot);
    const before = this.counters(slot);
    if (this.version === 'cgroup-v1') this.tryWrite(slot, 'memory', 'memory.max_usage_in_bytes', '0');
    // v1 moves the `sh` step's only thread by writing "0" (the writer itself) to `tasks`, which
    // spares the global lock a move by pid takes (thread-cgroup.ts says what that costs); v2
    // has no `tasks`, so there it is the pid into cgroup.procs.
    const [entryFile, who] = this.version === 'cgroup-v1' ? ['tasks', '0'] : ['cgroup.procs', '$$'];
    const entries = slot.dirs.map((d) => join(d.dir, entryFile));
    return {
      // Into every hierarchy before exec: from then on each fork is counted and charged.
      wrap: (argv) => [this.opts.shell, '-c', `p=${who}; while [ "$1" != -- ]; do echo "$p" > "$1" || exit 125; shift; done; shift; exec "$@"`, 'hutch-enter', ...entries, '--', ...argv],
      // v2 cannot hold one thread of a process in another cgroup (outside threaded mode).
      threadEntry: this.version === 'cgroup-v1' ? slot.dirs.map((d) => join(d.dir, 'tasks')) : undefined,
      kill: () => this.killAll(slot),
      signal: (sig) => this.signalAll(slot, sig),
      release: () => this.release(slot, before),
    };
  }

  async close(): Promise<void> {
    this.closed = true;
    for (const slot of this.free.splice(0)) this.destroy(slot);
    for (const h of this.hierarchies) {
      for (const dir of [h.pool, h.parent]) {
        try {
          rmdirSync(dir);
        } catch {
          // busy slots remain, or another broker in the same cgroup still has its pool there: left for them
        }
      }
    }
  }

  private async release(slot: Slot, before: Counters): Promise<RunLimitReport> {
    const drained = await this.drain(slot);
    const after = this.counters(slot);
    const peak = this.version === 'cgroup-v1' ? this.readNumber(slot, 'memory', 'memory.max_usage_in_bytes') : null;
    this.busy.delete(slot);
    if (!drained) {
      this.opts.log.warn('fastpath.cgroup.not_drained', { slot: slot.name, dirs: slot.dirs.map((d) => d.dir) });
    } else if (this.closed || this.free.length >= MAX_FREE_SLOTS) {
      this.destroy(slot);
    } else {
      this.free.push(slot);
    }
    return {
      mechanism: this.version,
      maxProcesses: this.opts.maxProcesses,
      memoryBytes: this.opts.memoryBytes,
      oomKilled: after.oomKills > before.oomKills,
      processLimitHit: after.pidsMax > before.pidsMax,
      peakMemoryBytes: peak,
    };
  }

  private createSlot(): Slot {
    const name = `slot-${process.pid}-${slotCounter++}`;
    const slot: Slot = { name, dirs: this.hierarchies.map((h) => ({ dir: join(h.pool, name), controllers: h.controllers })) };
    const made: Slot = { name, dirs: [] };
    try {
      for (const d of slot.dirs) {
        try {
          mkdirSync(d.dir);
        } catch (err) {
          if ((err as NodeJS.ErrnoException).code !== 'ENOENT') throw err;
          for (const h of this.hierarchies) this.ensurePool(h);
          mkdirSync(d.dir);
        }
        made.dirs.push(d); // on failure only what this call made is removed
      }
      const { maxProcesses, memoryBytes } = this.opts;
      this.write(slot, 'pids', 'pids.max', String(maxProcesses));
      if (this.version === 'cgroup-v2') {
        this.write(slot, 'memory', 'memory.max', String(memoryBytes));
        this.tryWrite(slot, 'memory', 'memory.swap.max', '0');
      } else {
        this.write(slot, 'memory', 'memory.limit_in_bytes', String(memoryBytes));
        // With swap accounting, memory+swap gets the same bound so the limit cannot be dodged into swap.
        this.tryWrite(slot, 'memory', 'memory.memsw.limit_in_bytes', String(memoryBytes));
      }
    } catch (err) {
      this.destroy(made);
      throw new HutchError('unavailable', `cannot set up a ${this.version} cgroup: ${(err as Error).message}`, { slot: name });
    }
    return slot;
  }

  private destroy(slot: Slot): void {
    for (const d of slot.dirs) {
      try {
        rmdirSync(d.dir);
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code !== 'ENOENT') this.opts.log.warn('fastpath.cgroup.rmdir_failed', { dir: d.dir, err });
      }
    }
  }

  private killAll(slot: Slot): void {
    if (this.version === 'cgroup-v2' && this.tryWrite(slot, 'pids', 'cgroup.kill', '1')) return;
    this.signalAll(slot, 'SIGKILL');
  }

  private signalAll(slot: Slot, sig: NodeJS.Signals): boolean {
    let sent = false;
    for (const pid of this.pids(slot)) {
      // A forker caught mid-fork in the slot (thread entry) is ours, not the tenant's.
      if (pid === process.pid || this.opts.isProtected?.(pid)) continue;
      try {
        process.kill(pid, sig);
        sent = true;
      } catch {
        // already gone
      }
    }
    return sent;
  }

  /** Kills stragglers until the slot is empty; false if it would not empty. */
  private async drain(slot: Slot): Promise<boolean> {
    const deadline = Date.now() + DRAIN_TIMEOUT_MS;
    while (this.pids(slot).some((pid) => pid !== process.pid && !this.opts.isProtected?.(pid))) {
      if (Date.now() > deadline) return false;
      this.killAll(slot);
      await sleep(5);
    }
    return true;
  }

  private pids(slot: Slot): number[] {
    const out = new Set<number>();
    for (const d of slot.dirs) {
      let text = '';
      try {
        text = readFileSync(join(d.dir, 'cgroup.procs'), 'utf8');
      } catch {
        continue;
      }
      for (const line of text.split('\n')) if (line) out.add(Number(line));
    }
    return [...out];
  }

  private counters(slot: Slot): Counters {
    const oomFile = this.version === 'cgroup-v2' ? 'memory.events' : 'memory.oom_control';
    return {
      oomKills: readKeyed(this.file(slot, 'memory', oomFile), 'oom_kill'),
      pidsMax: readKeyed(this.file(slot, 'pids', 'pids.events'), 'max'),
    };
  }

  /** Pools (and slots, as earlier brokers made them) of brokers that are gone: their processes killed, their cgroups removed. */
  private sweepStale(parent: string): void {
    for (const name of readdirSync(parent)) {
      const m = /^(slot|pool)-(\d+)-\d+$/.exec(name);
      if (!m || Number(m[2]) === process.pid || pidAlive(Number(m[2]))) continue;
      const dir = join(parent, name);
      const dirs = m[1] === 'pool' ? [...readdirSync(dir).filter((n) => n.startsWith('slot-')).map((n) => join(dir, n)), dir] : [dir];
      for (const d of dirs) {
        for (const pid of this.pids({ name, dirs: [{ dir: d, controllers: [] }] })) {
          try {
            process.kill(pid, 'SIGKILL');
          } catch {
            // gone
          }
        }
        try {
          rmdirSync(d);
          this.opts.log.info('fastpath.cgroup.swept', { dir: d });
        } catch (err) {
          this.opts.log.warn('fastpath.cgroup.sweep_failed', { dir: d, err });
        }
      }
    }
  }

  private file(slot: Slot, controller: Controller, name: string): string {
    const d = slot.dirs.find((x) => x.controllers.includes(controller)) ?? slot.dirs[0];
    if (!d) throw new HutchError('internal', 'cgroup slot without directories');
    return join(d.dir, name);
  }

  private write(slot: Slot, controller: Controller, name: string, value: string): void {
    writeFileSync(this.file(slot, controller, name), value);
  }

  private tryWrite(slot: Slot, controller: Controller, name: string, value: string): boolean {
    return tryWriteFile(this.file(slot, controller, name), value);
  }

  private readNumber(slot: Slot, controller: Controller, name: string): number | null {
    try {
      const n = Number(readFileSync(this.file(slot, controller, name), 'utf8').trim());
      return Number.isFinite(n) ? n : null;
    } catch {
      return null;
    }
  }
}

/** Writes a control file that this kernel may not have (swap accounting off, say); false when it could not. */
function tryWriteFile(path: string, value: string): boolean {
  if (!existsSync(path)) return false;
  try {
    writeFileSync(path, value);
    return true;
  } catch {
    return false;
  }
}

/** v2: a child cgroup only gets a controller its parent lists in cgroup.subtree_control. */
function enableControllers(dir: string, controllers: Controller[]): void {
  const enabled = readWords(join(dir, 'cgroup.subtree_control'));
  const missing = controllers.filter((c) => !enabled.includes(c));
  if (missing.length === 0) return;
  try {
    writeFileSync(join(dir, 'cgroup.subtree_control'), missing.map((c) => `+${c}`).join(' '));
  } catch (err) {
    // EBUSY: the cgroup holds processes (the broker itself) and is not the root; cgroup v2
    // then refuses to delegate controllers below it. A delegated cgroupParent fixes that.
    throw new HutchError('unavailable', `cannot enable ${missing.join(', ')} in ${dir}/cgroup.subtree_control: ${(err as NodeJS.ErrnoException).code ?? (err as Error).message}`, { dir });
  }
}

function readWords(path: string): string[] {
  try {
    return readFileSync(path, 'utf8').trim().split(/\s+/).filter(Boolean);
  } catch {
    return [];
  }
}

/** `key value` lines (pids.events, memory.events, memory.oom_control); 0 when absent. */
function readKeyed(path: string, key: string): number {
  try {
    for (const line of readFileSync(path, 'utf8').split('\n')) {
      const [k, v] = line.split(/\s+/);
      if (k === key) return Number(v) || 0;
    }
  } catch {
    // file missing on this kernel: the event cannot be reported
  }
  return 0;
}
