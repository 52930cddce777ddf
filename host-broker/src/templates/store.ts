/**
 * Templates on disk, under the broker's data dir (the same --data-dir `hutch serve` and
 * `hutch template` take, so a template built once can be copied to other hosts):
 *
 *   <data>/templates/by-id/<id>/rootfs.ext4      the template's root filesystem (read-only disk)
 *   <data>/templates/by-id/<id>/manifest.json    what it was built from and how (TemplateManifest)
 *   <data>/templates/by-id/<id>/snapshots/<key>/ its pristine snapshots (one per kernel + agent
 *                                                layer + VM size: snapshot-store.ts)
 *   <data>/templates/names/<name>.json           { id }: which build a name points at
 *
 * `id` is the hash of the build's inputs (content-addressed: the same inputs are not built
 * twice). Names are looked up on every create, so a running broker sees templates built
 * while it runs. Slots of a session stay with its template: a template's pristine snapshot
 * key includes the template's id, and a slot restores only onto the pristine it came from.
 */
import { existsSync, mkdirSync, readdirSync, readFileSync, renameSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { homedir } from 'node:os';
import { join, resolve } from 'node:path';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';

/** The template every session gets when it names none: hutch's Debian bookworm image. */
export const DEFAULT_TEMPLATE = 'default';

/**
 * The data dir of `hutch serve` and `hutch template` alike: --data-dir, else $HUTCH_DATA, else
 * ~/.local/state/hutch; a relative one is the caller's (./hutch runs from the repository and
 * says where it was called from in HUTCH_CALLER_CWD), so both commands mean the same directory.
 */
export function defaultDataDir(flag?: string): string {
  return resolve(process.env['HUTCH_CALLER_CWD'] ?? process.cwd(), flag ?? process.env['HUTCH_DATA'] ?? join(homedir(), '.local/state/hutch'));
}

/**
 * A template name: a file name under <data>/templates/names, so it may not hold a path:
 * lower-case letters, digits, '.', '_' and '-', starting with a letter or digit, at most 63.
 * (Refuses `../x`, `/abs`, NUL bytes, empty names, '.' and '..'.)
 */
export function validateTemplateName(name: unknown): string {
  if (typeof name !== 'string' || !/^[a-z0-9][a-z0-9._-]{0,62}$/.test(name) || name.includes('..')) {
    throw new HutchError('bad_request', `invalid template name ${JSON.stringify(String(name).slice(0, 80))}: use 1-63 of a-z 0-9 . _ - (starting with a letter or digit, no '..')`, { template: String(name).slice(0, 80) });
  }
  return name;
}

export interface TemplateSourceInfo {
  kind: 'tarball' | 'dir' | 'oci' | 'debootstrap';
  /** What the user named (a path, or debootstrap:SUITE). */
  ref: string;
  /** The content's identity: sha256 of the tarball, of the directory's tar, the OCI manifest digest, or suite + packages. */
  digest: string;
  packages?: string[];
}

export interface TemplateManifest {
  name: string;
  id: string;
  source: TemplateSourceInfo;
  run: string[];
  env: Record<string, string>;
  workdir: string;
  start?: string;
  memoryMiB: number;
  cpus: number;
  /** Build times in seconds: the build VM (unpack + --run steps) and the pristine snapshot boot. */
  buildSeconds: number;
  snapshotSeconds?: number;
  rootfsBytes: number;
  rootfsAllocatedBytes: number;
  builtAt: string;
  /** Hash of the build script and its code: part of `id`. */
  builder: string;
}

export interface TemplateEntry {
  name: string;
  manifest: TemplateManifest;
  dir: string;
  rootfs: string;
}

export class TemplateStore {
  readonly root: string;

  constructor(readonly dataDir: string) {
    this.root = join(dataDir, 'templates');
  }

  byId(id: string): string {
    if (!/^[0-9a-f]{16,64}$/.test(id)) throw new HutchError('internal', `bad template id ${JSON.stringify(id)}`);
    return join(this.root, 'by-id', id);
  }

  private nameFile(name: string): string {
    return join(this.root, 'names', `${validateTemplateName(name)}.json`);
  }

  /** A complete build with this id, if any (a manifest is written last). */
  readBuild(id: string): TemplateManifest | undefined {
    const dir = this.byId(id);
    try {
      const m = JSON.parse(readFileSync(join(dir, 'manifest.json'), 'utf8')) as TemplateManifest;
      return existsSync(join(dir, 'rootfs.ext4')) ? m : undefined;
    } catch {
      return undefined;
    }
  }

  /** The template a name points at; not_found when there is none. */
  resolve(name: string): TemplateEntry {
    const file = this.nameFile(name);
    let id: string;
    try {
      id = (JSON.parse(readFileSync(file, 'utf8')) as { id: string }).id;
    } catch {
      throw new HutchError('not_found', `no template named ${name} in ${this.root} (hutch template ls; build one with hutch template build ${name} --from SOURCE)`, { template: name });
    }
    const manifest = this.readBuild(id);
    if (!manifest) throw new HutchError('not_found', `template ${name} points at build ${id}, which is missing or incomplete; build it again`, { template: name, id });
    const dir = this.byId(id);
    return { name, manifest: { ...manifest, name }, dir, rootfs: join(dir, 'rootfs.ext4') };
  }

  /** Points `name` at build `id` (atomically: a reader sees the old or the new one). */
  setName(name: string, id: string): void {
    const file = this.nameFile(name);
    mkdirSync(join(this.root, 'names'), { recursive: true });
    const tmp = `${file}.tmp-${process.pid}`;
    writeFileSync(tmp, `${JSON.stringify({ id, at: new Date().toISOString() })}\n`);
    renameSync(tmp, file);
  }

  list(): TemplateEntry[] {
    let names: string[] = [];
    try {
      names = readdirSync(join(this.root, 'names'));
    } catch {
      return [];
    }
    const out: TemplateEntry[] = [];
    for (const f of names.sort()) {
      const m = /^(.+)\.json$/.exec(f);
      if (!m?.[1]) continue;
      try {
        out.push(this.resolve(m[1]));
      } catch {
        // a name without its build: `rm` removes it
      }
    }
    return out;
  }

  /** Removes a name, and its build when no other name points at it. */
  remove(name: string): { removedBuild: boolean } {
    const entry = this.resolve(name);
    rmSync(this.nameFile(name), { force: true });
    const stillUsed = this.list().some((e) => e.manifest.id === entry.manifest.id);
    if (!stillUsed) rmSync(entry.dir, { recursive: true, force: true });
    return { removedBuild: !stillUsed };
  }

  /** Removes builds no name points at (left by rebuilds with other inputs); returns their ids. */
  removeUnnamed(): string[] {
    const named = new Set(this.list().map((e) => e.manifest.id));
    let ids: string[] = [];
    try {
      ids = readdirSync(join(this.root, 'by-id')).filter((n) => /^[0-9a-f]{16,64}$/.test(n));
    } catch {
      return [];
    }
    const gone = ids.filter((id) => !named.has(id));
    for (const id of gone) rmSync(this.byId(id), { recursive: true, force: true });
    return gone;
  }

  /** Bytes a build holds on disk (sparse files count what they use). */
  static allocatedBytes(dir: string): number {
    let total = 0;
    const walk = (d: string) => {
      for (const e of readdirSync(d, { withFileTypes: true })) {
        const p = join(d, e.name);
        if (e.isDirectory()) walk(p);
        else if (e.isFile()) total += statSync(p).blocks * 512;
      }
    };
    walk(dir);
    return total;
  }
}
