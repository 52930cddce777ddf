import { existsSync, mkdirSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import type { z } from 'zod';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import type { CreateParams, SessionInfo } from '../api/harness-protocol.ts';
import { Session, type SessionDeps, type SessionMeta } from './session.ts';
import { populateWorkspace } from './workspace-source.ts';

export const DEFAULT_CPUS = 1;
export const DEFAULT_MEMORY_MIB = 512;

/**
 * Owns the sessions: creates them with their workspace under the data dir, finds them
 * for attach, closes them. Session metadata is on disk, so a broker restart keeps every
 * workspace and its sessions can be attached again.
 *
 *   <data-dir>/sessions/<id>/session.json
 *   <data-dir>/sessions/<id>/workspace/     the host-owned workspace (source of truth)
 *   <data-dir>/sessions/<id>/state/         backend state (home, sockets, disks, snapshots)
 */
export class SessionManager {
  private readonly sessions = new Map<string, Session>();
  private readonly root: string;

  constructor(
    dataDir: string,
    private readonly deps: SessionDeps,
    private readonly log: Logger,
  ) {
    this.root = join(dataDir, 'sessions');
    mkdirSync(this.root, { recursive: true });
  }

  /** Re-adopts sessions left on disk by an earlier broker. */
  loadExisting(): number {
    for (const id of readdirSync(this.root)) {
      const metaPath = join(this.root, id, 'session.json');
      if (!existsSync(metaPath)) continue;
      try {
        const meta = JSON.parse(readFileSync(metaPath, 'utf8')) as SessionMeta;
        this.sessions.set(id, this.make(meta));
      } catch (err) {
        this.log.warn('session.load_failed', { session: id, error: (err as Error).message });
      }
    }
    return this.sessions.size;
  }

  async create(p: z.infer<typeof CreateParams>): Promise<Session> {
    const id = p.id ?? `s-${randomBytes(6).toString('hex')}`;
    if (this.sessions.has(id) || existsSync(join(this.root, id))) throw new HutchError('already_exists', `session ${id} already exists`, { session: id });
    const meta: SessionMeta = { id, cpus: p.cpus ?? DEFAULT_CPUS, memoryMiB: p.memoryMiB ?? DEFAULT_MEMORY_MIB, createdAt: new Date().toISOString() };
    const dir = join(this.root, id);
    mkdirSync(join(dir, 'workspace'), { recursive: true });
    mkdirSync(join(dir, 'state'), { recursive: true });
    const session = this.make(meta);
    try {
      if (p.workspace) await populateWorkspace(session.workspaceDir, p.workspace, { files: session.files, fastPath: this.deps.fastPath });
      writeFileSync(join(dir, 'session.json'), JSON.stringify(meta, null, 2));
    } catch (err) {
      rmSync(dir, { recursive: true, force: true });
      throw err;
    }
    this.sessions.set(id, session);
    this.log.info('session.created', { session: id, cpus: meta.cpus, memoryMiB: meta.memoryMiB });
    return session;
  }

  get(id: string): Session {
    const s = this.sessions.get(id);
    if (!s) throw new HutchError('not_found', `no session ${id}`, { session: id });
    return s;
  }

  all(): Session[] {
    return [...this.sessions.values()];
  }

  list(): SessionInfo[] {
    return [...this.sessions.values()].map((s) => s.info());
  }

  async close(id: string, keepWorkspace = false): Promise<{ session: string; workspace?: string }> {
    const s = this.get(id);
    this.sessions.delete(id);
    await s.close();
    const dir = join(this.root, id);
    if (keepWorkspace) {
      // The workspace stays for the caller; the session itself is gone.
      rmSync(join(dir, 'session.json'), { force: true });
      rmSync(join(dir, 'state'), { recursive: true, force: true });
      this.log.info('session.closed', { session: id, kept: s.workspaceDir });
      return { session: id, workspace: s.workspaceDir };
    }
    rmSync(dir, { recursive: true, force: true });
    this.log.info('session.closed', { session: id });
    return { session: id };
  }

  /** Releases every sandbox (dirty ones into their snapshot slots); workspaces and metadata stay for the next broker. */
  async shutdown(): Promise<void> {
    await Promise.all([...this.sessions.values()].map((s) => s.shutdown()));
    this.sessions.clear();
  }

  private make(meta: SessionMeta): Session {
    const dir = join(this.root, meta.id);
    return new Session(meta, join(dir, 'workspace'), join(dir, 'state'), this.deps);
  }
}
