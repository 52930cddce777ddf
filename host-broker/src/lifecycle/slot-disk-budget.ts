import { statfsSync } from 'node:fs';

/**
 * The data dir's disk that snapshot slots may take, in all and per principal. A slot holds
 * a VM's RAM and swap (up to 2.5 GiB for a 2 GiB VM) and each session keeps two, so a
 * principal's 128 sessions, each dirtying its VM's memory and then idling, could write
 * hundreds of GB and fill the disk that every tenant's workspace lives on.
 *
 * A release asks before it writes a slot, for the most that slot can take; what it wrote is
 * measured after and held until the session's slots change again or it closes. Refused, the
 * release keeps the VM reclaimed instead (its memory is already the principal's), so nothing
 * is lost; only a VM that stops anyway (a broker shutdown) may then lose its state.
 */
export interface SlotDiskOptions {
  /** Bytes all sessions' slots may hold together. */
  totalBytes: number;
  /** Bytes one principal's slots may hold. */
  principalBytes: number;
  /** Free bytes a slot write must leave on the data dir's filesystem (workspaces need room too). */
  reserveBytes: number;
  /** The data dir: the filesystem whose free space is checked. */
  dir: string;
  /** Free bytes of `dir`'s filesystem (statfs; tests give their own). */
  freeBytes?: (dir: string) => number;
}

/** What a release was granted: settle it with the session's slot bytes once the write ended (or failed). */
export interface SlotGrant {
  settle(heldBytes: number): void;
}

/** Half the filesystem for slots, and at least 5% of it (2 GiB at least) left free by any write. */
export function defaultSlotDisk(dir: string, principals: number): SlotDiskOptions {
  const size = filesystemBytes(dir);
  const totalBytes = Math.floor(size / 2);
  return { dir, totalBytes, principalBytes: principals > 1 ? Math.floor(totalBytes / 2) : totalBytes, reserveBytes: Math.max(2 * 1024 ** 3, Math.floor(size * 0.05)) };
}

export class SlotDiskBudget {
  /** Session -> its principal and the bytes its slots hold now, plus what a write in progress may add. */
  private readonly sessions = new Map<string, { principal: string; held: number; pending: number }>();

  constructor(readonly opts: SlotDiskOptions) {}

  /** Records what a session's slots hold on disk (measured: at start, after a write, after a clear). */
  set(session: string, principal: string, heldBytes: number): void {
    const s = this.sessions.get(session);
    if (s) s.held = heldBytes;
    else this.sessions.set(session, { principal, held: heldBytes, pending: 0 });
  }

  /** The session closed: its slots are gone with its directory. */
  forget(session: string): void {
    this.sessions.delete(session);
  }

  /** Bytes held (and being written) by one principal's slots, or by all. */
  heldBytes(principal?: string): number {
    let n = 0;
    for (const s of this.sessions.values()) if (principal === undefined || s.principal === principal) n += s.held + s.pending;
    return n;
  }

  /**
   * Asks for room to write a slot of at most `maxBytes` that replaces `replacedBytes` of the
   * session's (the older slot, removed first). `final` (the VM stops anyway: a broker
   * shutdown) is held only to the free-space reserve, not to the shares: the state it keeps
   * would otherwise be lost, and it counts against the principal from then on.
   * Returns the grant, or why not.
   */
  reserve(session: string, principal: string, maxBytes: number, replacedBytes: number, final = false): SlotGrant | { refused: string } {
    const s = this.sessions.get(session) ?? { principal, held: 0, pending: 0 };
    this.sessions.set(session, s);
    const delta = Math.max(0, maxBytes - replacedBytes);
    const mib = (b: number) => `${Math.round(b / 1048576)} MiB`;
    const free = (this.opts.freeBytes ?? freeBytes)(this.opts.dir) - this.pendingBytes();
    if (free - delta < this.opts.reserveBytes) return { refused: `a slot of up to ${mib(maxBytes)} would leave ${mib(free - delta)} free on the data dir's disk, under the ${mib(this.opts.reserveBytes)} kept free` };
    if (!final) {
      const mine = this.heldBytes(principal);
      if (mine + delta > this.opts.principalBytes) return { refused: `principal ${principal}'s slots hold ${mib(mine)}; a slot of up to ${mib(maxBytes)} would pass its ${mib(this.opts.principalBytes)} of slot disk` };
      const all = this.heldBytes();
      if (all + delta > this.opts.totalBytes) return { refused: `slots hold ${mib(all)}; a slot of up to ${mib(maxBytes)} would pass the ${mib(this.opts.totalBytes)} of slot disk` };
    }
    s.pending += delta;
    let settled = false;
    return {
      settle: (heldBytes: number) => {
        if (settled) return;
        settled = true;
        s.pending -= delta;
        s.held = heldBytes;
      },
    };
  }

  private pendingBytes(): number {
    let n = 0;
    for (const s of this.sessions.values()) n += s.pending;
    return n;
  }
}

function freeBytes(dir: string): number {
  const st = statfsSync(dir);
  return st.bavail * st.bsize;
}

function filesystemBytes(dir: string): number {
  const st = statfsSync(dir);
  return st.blocks * st.bsize;
}
