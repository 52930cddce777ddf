import { readFileSync } from 'node:fs';

/**
 * Directories the broker's file watchers may watch at once, all of them together. Each is
 * an inotify watch, and the kernel's limit (fs.inotify.max_user_watches) is per user and
 * host-wide: whatever else runs as the broker's user (systemd, editors, other daemons) draws
 * on it too. The workspace trackers and the E2B watches of every tenant charge one budget,
 * so no number of tenants can spend the host's watches; a watcher that finds it spent gives
 * up the way it does past its own limit.
 */
export class WatchBudget {
  private usedDirs = 0;

  constructor(readonly maxDirs: number) {}

  get used(): number {
    return this.usedDirs;
  }

  /** Charges one directory; false when the budget is spent. */
  take(): boolean {
    if (this.usedDirs >= this.maxDirs) return false;
    this.usedDirs++;
    return true;
  }

  give(dirs: number): void {
    this.usedDirs = Math.max(0, this.usedDirs - dirs);
  }
}

/** Half the user's inotify watches (the other half stays for everything else the user runs); 8,192 if the limit cannot be read. */
function defaultMaxDirs(): number {
  try {
    const max = Number(readFileSync('/proc/sys/fs/inotify/max_user_watches', 'utf8').trim());
    if (Number.isInteger(max) && max > 0) return Math.floor(max / 2);
  } catch {
    // not Linux, or no procfs
  }
  return 8192;
}

/** The process's budget: the kernel's limit is per user, so one budget for every watcher of the broker. */
export const watchBudget = new WatchBudget(defaultMaxDirs());
