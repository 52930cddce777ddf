/**
 * Keeps a session's fast-path git run apart from the workspace writes that do not go
 * through the session's call queue: a streamed upload's commit, an E2B file call, a VM's
 * release pull. The router reads every configuration git can reach before the call runs
 * (router/git-config.ts); a write landing between that check and git's start (an upload
 * replacing `.git/config` while the command's first part runs) would have git read what
 * nobody checked. Writers overlap each other; a git run waits for the writes in progress
 * and holds new ones off until it ends (so at most the call's own timeout). First come,
 * first served, so neither side starves the other.
 */
export type GateSide = 'git' | 'write';

export class WorkspaceGate {
  private readonly active: Record<GateSide, number> = { git: 0, write: 0 };
  private readonly queue: Array<{ side: GateSide; admit: () => void }> = [];

  /** Waits for the other side to finish; the returned function leaves (idempotent). */
  enter(side: GateSide): Promise<() => void> {
    return new Promise((resolve) => {
      this.queue.push({ side, admit: () => resolve(this.leaver(side)) });
      this.pump();
    });
  }

  async run<T>(side: GateSide, fn: () => Promise<T>): Promise<T> {
    const leave = await this.enter(side);
    try {
      return await fn();
    } finally {
      leave();
    }
  }

  private pump(): void {
    for (let head = this.queue[0]; head; head = this.queue[0]) {
      if (this.active[head.side === 'git' ? 'write' : 'git'] > 0) return;
      this.queue.shift();
      this.active[head.side]++;
      head.admit();
    }
  }

  private leaver(side: GateSide): () => void {
    let left = false;
    return () => {
      if (left) return;
      left = true;
      this.active[side]--;
      this.pump();
    };
  }
}
