import { chmodSync, closeSync, constants, existsSync, mkdirSync, openSync, readdirSync, readFileSync, renameSync, rmSync, writeFileSync } from 'node:fs';
import { removeTreeAt, renameAt } from '../../../guest-agent/src/workspace/fd-path.ts';
import { DEFAULT_TEMPLATE, validateTemplateName } from '../templates/store.ts';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import type { z } from 'zod';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../../guest-agent/src/log.ts';
import type { CloseResult, CreateParams, NetworkSpec, SessionInfo } from '../api/harness-protocol.ts';
import { DEFAULT_PRINCIPAL } from '../api/principals.ts';
import { Session, type SessionDeps, type SessionMeta } from './session.ts';
import { populateWorkspace } from './workspace-source.ts';
import { DEFAULT_QUOTA } from './workspace-quota.ts';
import { DEFAULT_SESSION_SIZES, sessionSize, type SessionSizes } from './session-sizes.ts';

/**
 * Sessions one principal may hold, kept workspaces included. Each holds up to its quota of
 * the data dir's disk (2 GiB by default), and kept workspaces stay until the operator
 * removes them, so without a count a token holder filled the host's disk by creating (or
 * creating and closing with keepWorkspace) sessions in a loop.
 */
export const DEFAULT_MAX_SESSIONS_PER_PRINCIPAL = 128;

/**
 * A new session's id: 128 random bits, so nobody can guess another principal's. A tenant
 * never chooses one (a gateway does, with its credential, for the broker it placed on).
 */
export function newSessionId(): string {
  return `s-${randomBytes(16).toString('hex')}`;
}

/** In a kept workspace's session dir: whose it was (it counts against that principal). */
const KEPT_FILE = 'kept.json';

/** session.json: the session's metadata plus the principal that owns it. */
type StoredMeta = SessionMeta & { owner?: string };

/**
 * A directory only root can enter: workspaces hold tenants' files (and, until pulled back
 * and checked, whatever a tenant made), so no other host user may reach into them.
 */
export function privateDir(path: string): void {
  mkdirSync(path, { recursive: true, mode: 0o700 });
  chmodSync(path, 0o700); // mkdir's mode is masked by the umask and skipped for existing dirs
}

/** A session directory being removed (renamed aside first; see removeSessionDir). Session ids never start with a dot. */
const REMOVING_PREFIX = '.removing-';

export interface SessionManagerOptions {
  /** Host directories `create({ workspace: { dir } })` may copy from; none = dir sources refused. */
  workspaceRoots?: readonly string[];
  /** Sessions plus kept workspaces per principal (default DEFAULT_MAX_SESSIONS_PER_PRINCIPAL). */
  maxSessionsPerPrincipal?: number;
  /** The VM sizes a create may ask for (default DEFAULT_SESSION_SIZES; see session-sizes.ts). */
  sizes?: SessionSizes;
}

/**
 * Owns the sessions: creates them with their workspace under the data dir, finds them
 * for attach, closes them. Session metadata is on disk, so a broker restart keeps every
 * workspace and its sessions can be attached again.
 *
 *   <data-dir>/sessions/<id>/session.json
 *   <data-dir>/sessions/<id>/workspace/     the host-owned workspace (source of truth)
 *   <data-dir>/sessions/<id>/state/         backend state (home, sockets, disks, snapshots)
 *   <data-dir>/sessions/.removing-<id>/     a closed session's directory on its way out
 */
export class SessionManager {
  private readonly sessions = new Map<string, Session>();
  /** Session id -> owning principal. */
  private readonly owners = new Map<string, string>();
  /** Principal -> workspaces its closed sessions kept (they hold disk until the operator removes them). */
  private readonly kept = new Map<string, number>();
  /** Principal -> creates not finished yet. */
  private readonly creating = new Map<string, number>();
  private readonly root: string;

  constructor(
    dataDir: string,
    private readonly deps: SessionDeps,
    private readonly log: Logger,
    private readonly opts: SessionManagerOptions = {},
  ) {
    privateDir(dataDir);
    this.root = join(dataDir, 'sessions');
    privateDir(this.root);
  }

  /** Re-adopts sessions left on disk by an earlier broker. */
  loadExisting(): number {
    for (const id of readdirSync(this.root)) {
      if (id.startsWith(REMOVING_PREFIX)) {
        // A close the previous broker did not finish.
        void this.removeAside(id).catch((err: unknown) => this.log.warn('session.remove_failed', { dir: id, error: (err as Error).message }));
        continue;
      }
      const metaPath = join(this.root, id, 'session.json');
      if (!existsSync(metaPath)) {
        this.countKept(id);
        continue;
      }
      try {
        const { owner, ...meta } = JSON.parse(readFileSync(metaPath, 'utf8')) as StoredMeta;
        chmodSync(join(this.root, id), 0o700); // made by an older broker, maybe with a looser mode
        // Sessions from before principals existed belong to the single-token principal.
        this.owners.set(id, owner ?? DEFAULT_PRINCIPAL);
        this.sessions.set(id, this.make(meta, owner ?? DEFAULT_PRINCIPAL));
      } catch (err) {
        this.log.warn('session.load_failed', { session: id, error: (err as Error).message });
      }
    }
    return this.sessions.size;
  }

  /** A session dir without session.json: a kept workspace, counted against whoever kept it. */
  private countKept(id: string): void {
    try {
      const { owner } = JSON.parse(readFileSync(join(this.root, id, KEPT_FILE), 'utf8')) as { owner?: unknown };
      if (typeof owner === 'string') this.kept.set(owner, (this.kept.get(owner) ?? 0) + 1);
    } catch {
      // Kept before owners were recorded, or not a session dir: nobody's to count.
    }
  }

  async create(p: z.infer<typeof CreateParams>, owner: string = DEFAULT_PRINCIPAL): Promise<Session> {
    const id = p.id ?? newSessionId();
    const max = this.opts.maxSessionsPerPrincipal ?? DEFAULT_MAX_SESSIONS_PER_PRINCIPAL;
    // Creates in flight count too: each awaits its workspace source before it is listed.
    const open = [...this.owners.values()].filter((o) => o === owner).length + (this.creating.get(owner) ?? 0);
    const kept = this.kept.get(owner) ?? 0;
    if (open + kept >= max) {
      throw new HutchError('quota_exceeded', `principal ${owner} holds ${open} sessions and ${kept} kept workspaces, its limit of ${max}: close a session${kept ? ' (kept workspaces count until the operator removes them from the data dir)' : ''}`, {
        limit: 'sessions',
        quota: max,
        sessions: open,
        kept,
      });
    }
    // The same answer whoever owns an existing id: which ids others use is not told.
    if (this.sessions.has(id) || existsSync(join(this.root, id))) throw new HutchError('already_exists', `session ${id} already exists`, { session: id });
    const broker = this.deps.quota ?? DEFAULT_QUOTA;
    for (const k of ['bytes', 'files'] as const) {
      const asked = p.quota?.[k];
      if (asked !== undefined && asked > broker[k]) throw new HutchError('bad_request', `quota.${k} may be at most the broker's ${broker[k]} (asked ${asked})`, { limit: k, asked, quota: broker[k] });
    }
    const quota = { bytes: p.quota?.bytes ?? broker.bytes, files: p.quota?.files ?? broker.files };
    const size = sessionSize(this.opts.sizes ?? DEFAULT_SESSION_SIZES, p);
    const template = p.template === undefined || p.template === DEFAULT_TEMPLATE ? undefined : validateTemplateName(p.template);
    if (template !== undefined) {
      if (!this.deps.backend.checkTemplate) throw new HutchError('unavailable', `the ${this.deps.backend.name} backend has no templates (the qemu backend boots them)`, { template });
      this.deps.backend.checkTemplate(template);
    }
    // A malformed rule, or more egress than the operator allows, is refused before anything is made.
    this.deps.networks?.resolve(p.network);
    const meta: SessionMeta = { id, ...size, ...(template ? { template } : {}), createdAt: new Date().toISOString(), quota, ...(p.network !== undefined ? { network: p.network } : {}), ...(p.publicPorts === 'all' ? { publicPorts: 'all' as const } : p.publicPorts?.length ? { publicPorts: [...new Set(p.publicPorts)] } : {}) };
    const dir = join(this.root, id);
    privateDir(dir);
    mkdirSync(join(dir, 'workspace'), { recursive: true });
    mkdirSync(join(dir, 'state'), { recursive: true });
    const session = this.make(meta, owner);
    this.creating.set(owner, (this.creating.get(owner) ?? 0) + 1);
    try {
      await session.quota.measure(); // empty: inline files are planned against it as they are written
      if (p.workspace) await populateWorkspace(session.workspaceDir, p.workspace, { files: session.files, fastPath: this.deps.fastPath, roots: this.opts.workspaceRoots ?? [] });
      // Measured once here (then kept current call by call): a source above the quota is refused.
      session.quota.check(await session.quota.measure(), 'the workspace source');
      const stored: StoredMeta = { ...meta, owner };
      writeFileSync(join(dir, 'session.json'), JSON.stringify(stored, null, 2), { mode: 0o600 });
    } catch (err) {
      await this.removeSessionDir(id).catch(() => undefined);
      throw err;
    } finally {
      this.creating.set(owner, (this.creating.get(owner) ?? 1) - 1);
    }
    this.owners.set(id, owner);
    this.sessions.set(id, session);
    this.log.info('session.created', { session: id, owner, cpus: meta.cpus, memoryMiB: meta.memoryMiB });
    return session;
  }

  /** Changes a live session's network (its next connections use it) and keeps the change across restarts. */
  setNetwork(id: string, spec: NetworkSpec, principal?: string): Session {
    const session = this.get(id, principal);
    const policy = this.deps.networks?.resolve(spec);
    if (!policy || !session.network) throw new HutchError('unavailable', 'this broker serves no network to sandboxes', { session: id });
    session.meta.network = spec;
    const path = join(this.root, id, 'session.json');
    const stored: StoredMeta = { ...session.meta, owner: this.owners.get(id) ?? DEFAULT_PRINCIPAL };
    writeFileSync(`${path}.tmp`, JSON.stringify(stored, null, 2), { mode: 0o600 });
    renameSync(`${path}.tmp`, path);
    session.network.setPolicy(policy);
    this.log.info('session.network', { session: id, network: session.network.describe() });
    return session;
  }

  /**
   * A session as `principal` may see it: another principal's session answers exactly as a
   * missing one does. Without a principal (broker-internal use), any session.
   */
  get(id: string, principal?: string): Session {
    const s = this.sessions.get(id);
    if (!s || (principal !== undefined && this.owners.get(id) !== principal)) throw new HutchError('not_found', `no session ${id}`, { session: id });
    return s;
  }

  /** A session whoever owns it (broker-internal: a public port's request carries no principal). */
  find(id: string): Session | undefined {
    return this.sessions.get(id);
  }

  ownerOf(id: string): string | undefined {
    return this.owners.get(id);
  }

  /** Every session (broker-internal), or those of one principal. */
  all(principal?: string): Session[] {
    return [...this.sessions.values()].filter((s) => principal === undefined || this.owners.get(s.id) === principal);
  }

  list(principal?: string): SessionInfo[] {
    return this.all(principal).map((s) => s.info());
  }

  async close(id: string, keepWorkspace = false, principal?: string): Promise<CloseResult> {
    const s = this.get(id, principal);
    const owner = this.owners.get(id) ?? DEFAULT_PRINCIPAL;
    this.sessions.delete(id);
    this.owners.delete(id);
    await s.close();
    const dir = join(this.root, id);
    if (keepWorkspace) {
      // The workspace stays under the data dir (sessions/<id>/workspace) for the operator; the
      // answer names the session only, since the caller has no business with host paths.
      writeFileSync(join(dir, KEPT_FILE), JSON.stringify({ owner, keptAt: new Date().toISOString() }), { mode: 0o600 });
      rmSync(join(dir, 'session.json'), { force: true });
      rmSync(join(dir, 'state'), { recursive: true, force: true });
      this.kept.set(owner, (this.kept.get(owner) ?? 0) + 1);
      this.log.info('session.closed', { session: id, kept: s.workspaceDir });
      return { session: id, kept: true };
    }
    await this.removeSessionDir(id);
    this.log.info('session.closed', { session: id });
    return { session: id, kept: false };
  }

  /**
   * Removes a session's directory, however deep a tenant made its workspace (fd-path.ts
   * removeTreeAt; fs.rm fails past PATH_MAX). It is renamed aside first, so a broker that
   * dies midway leaves a name loadExisting finishes removing, not a session without its
   * session.json.
   */
  private async removeSessionDir(id: string): Promise<void> {
    const aside = `${REMOVING_PREFIX}${id}`;
    const rootFd = openSync(this.root, constants.O_RDONLY | constants.O_DIRECTORY);
    try {
      renameAt(rootFd, Buffer.from(id), rootFd, Buffer.from(aside));
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === 'ENOENT') return;
      throw err;
    } finally {
      closeSync(rootFd);
    }
    await this.removeAside(aside);
  }

  private async removeAside(name: string): Promise<void> {
    const rootFd = openSync(this.root, constants.O_RDONLY | constants.O_DIRECTORY);
    try {
      await removeTreeAt(rootFd, Buffer.from(name));
    } finally {
      closeSync(rootFd);
    }
  }

  /** Releases every sandbox (dirty ones into their snapshot slots); workspaces and metadata stay for the next broker. */
  async shutdown(): Promise<void> {
    await Promise.all([...this.sessions.values()].map((s) => s.shutdown()));
    this.sessions.clear();
    this.owners.clear();
  }

  private make(meta: SessionMeta, owner: string): Session {
    const dir = join(this.root, meta.id);
    return new Session(meta, join(dir, 'workspace'), join(dir, 'state'), this.deps, owner);
  }
}
