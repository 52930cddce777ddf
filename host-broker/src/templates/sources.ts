/**
 * A template's SOURCE, turned into "layers": tar streams the build VM unpacks in order
 * (guest/build.sh). The host only ever reads a source as bytes (hashing, copying, and for a
 * directory, GNU tar reading it without following symlinks): nothing of an untrusted
 * source is unpacked, interpreted as a filesystem or run on the host.
 *
 *   path/to/rootfs.tar[.gz]   a root filesystem tarball (docker/podman export, tar -C dir -c .)
 *   path/to/dir/              a directory holding a root filesystem (tarred, as it is)
 *   path/to/oci-layout/       an OCI image layout (oci-layout + index.json + blobs/sha256/),
 *                             linux/amd64; its layers in order, whiteouts applied in the VM
 *   debootstrap:SUITE         Debian SUITE (minbase) plus --packages, built with debootstrap on
 *                             the host from signature-checked Debian packages (no VM
 *                             needed), cached under ~/.cache/hutch by suite + packages
 */
import { createHash } from 'node:crypto';
import { createReadStream, openSync, readSync, closeSync, readFileSync, statSync, existsSync } from 'node:fs';
import { join } from 'node:path';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { run } from '../../../build/run.ts';
import type { TemplateSourceInfo } from './store.ts';
import { debootstrapTarball } from './debootstrap.ts';

export interface SourceLayer {
  file: string;
  bytes: number;
  compression: 'none' | 'gzip';
  /** OCI whiteouts (.wh.NAME, .wh..wh..opq) apply to the layers below. */
  whiteouts: boolean;
}

export interface PreparedSource {
  info: TemplateSourceInfo;
  layers: SourceLayer[];
}

/** Largest OCI index/manifest read into memory (they are a few KiB). */
const MAX_OCI_JSON = 4 * 1024 * 1024;

export async function sha256File(file: string): Promise<string> {
  const h = createHash('sha256');
  for await (const c of createReadStream(file)) h.update(c as Buffer);
  return h.digest('hex');
}

function head(file: string, n: number): Buffer {
  const fd = openSync(file, 'r');
  try {
    const b = Buffer.alloc(n);
    const got = readSync(fd, b, 0, n, 0);
    return b.subarray(0, got);
  } finally {
    closeSync(fd);
  }
}

/** gzip or plain tar, by their magic; anything else is refused (xz, zstd: not supported yet). */
function compressionOf(file: string): 'none' | 'gzip' {
  const b = head(file, 512);
  if (b.length >= 2 && b[0] === 0x1f && b[1] === 0x8b) return 'gzip';
  if (b.length >= 262 && b.subarray(257, 262).toString('latin1') === 'ustar') return 'none';
  if (b.length >= 6 && b[0] === 0xfd && b.subarray(1, 6).toString('latin1') === '7zXZ\0') throw new HutchError('bad_request', `${file}: xz-compressed tarballs are not supported yet (decompress it first)`);
  if (b.length >= 4 && b.readUInt32LE(0) === 0xfd2fb528) throw new HutchError('bad_request', `${file}: zstd-compressed tarballs are not supported yet (decompress it first)`);
  throw new HutchError('bad_request', `${file} is neither a tar archive nor a gzip-compressed one`);
}

async function tarballLayer(file: string, whiteouts: boolean): Promise<SourceLayer> {
  return { file, bytes: statSync(file).size, compression: compressionOf(file), whiteouts };
}

function readJson(file: string, what: string): Record<string, unknown> {
  const st = statSync(file, { throwIfNoEntry: false });
  if (!st?.isFile()) throw new HutchError('bad_request', `OCI layout: ${what} (${file}) is missing`);
  if (st.size > MAX_OCI_JSON) throw new HutchError('too_large', `OCI layout: ${what} is ${st.size} bytes (at most ${MAX_OCI_JSON})`);
  try {
    return JSON.parse(readFileSync(file, 'utf8')) as Record<string, unknown>;
  } catch (err) {
    throw new HutchError('bad_request', `OCI layout: ${what} is not JSON: ${(err as Error).message}`);
  }
}

/** blobs/sha256/<hex> for a digest; only sha256 digests, so a digest can never name another path. */
function blobPath(layout: string, digest: unknown): string {
  if (typeof digest !== 'string' || !/^sha256:[0-9a-f]{64}$/.test(digest)) throw new HutchError('bad_request', `OCI layout: unsupported digest ${JSON.stringify(digest)} (sha256 only)`);
  return join(layout, 'blobs', 'sha256', digest.slice('sha256:'.length));
}

async function verifiedBlob(layout: string, digest: unknown): Promise<string> {
  const p = blobPath(layout, digest);
  if (!statSync(p, { throwIfNoEntry: false })?.isFile()) throw new HutchError('bad_request', `OCI layout: blob ${String(digest)} is missing`);
  const actual = await sha256File(p);
  if (`sha256:${actual}` !== digest) throw new HutchError('bad_request', `OCI layout: blob ${String(digest)} has sha256 ${actual}`);
  return p;
}

type Descriptor = { mediaType?: string; digest?: string; platform?: { architecture?: string; os?: string } };

async function ociSource(layout: string): Promise<PreparedSource> {
  let index = readJson(join(layout, 'index.json'), 'index.json');
  let desc: Descriptor | undefined;
  // An index may point at a further index (docker's multi-platform images): follow, bounded.
  for (let depth = 0; depth < 4; depth++) {
    const manifests = (index['manifests'] as Descriptor[] | undefined) ?? [];
    desc = manifests.find((m) => !m.platform || (m.platform.architecture === 'amd64' && m.platform.os === 'linux'));
    if (!desc) throw new HutchError('bad_request', `OCI layout ${layout}: no linux/amd64 manifest`);
    if (!/index/.test(desc.mediaType ?? '')) break;
    index = readJson(await verifiedBlob(layout, desc.digest), 'nested index');
  }
  if (!desc) throw new HutchError('bad_request', `OCI layout ${layout}: no manifest`);
  const manifest = readJson(await verifiedBlob(layout, desc.digest), 'manifest');
  const layers: SourceLayer[] = [];
  for (const l of (manifest['layers'] as Descriptor[] | undefined) ?? []) {
    const mt = l.mediaType ?? '';
    if (/zstd/.test(mt)) throw new HutchError('bad_request', `OCI layout: zstd layers (${mt}) are not supported yet`);
    if (!/tar/.test(mt)) throw new HutchError('bad_request', `OCI layout: layer media type ${mt} is not a tar layer`);
    layers.push(await tarballLayer(await verifiedBlob(layout, l.digest), true));
  }
  if (layers.length === 0) throw new HutchError('bad_request', `OCI layout ${layout}: the manifest has no layers`);
  return { info: { kind: 'oci', ref: layout, digest: String(desc.digest) }, layers };
}

/**
 * Prepares SOURCE. `work` is a private (0700) directory of this build: a directory source is
 * tarred there, name-sorted with numeric owners, so the same tree gives the same digest.
 */
export async function prepareSource(from: string, opts: { packages?: string[]; work: string; log: (m: string) => void }): Promise<PreparedSource> {
  if (opts.packages && opts.packages.length > 0 && !from.startsWith('debootstrap:')) throw new HutchError('bad_request', '--packages goes with --from debootstrap:SUITE only');
  if (from.startsWith('debootstrap:')) {
    const suite = from.slice('debootstrap:'.length);
    const t = await debootstrapTarball(suite, opts.packages ?? [], opts.log);
    return { info: { kind: 'debootstrap', ref: from, digest: t.key, packages: t.packages }, layers: [await tarballLayer(t.tarball, false)] };
  }
  const st = statSync(from, { throwIfNoEntry: false });
  if (!st) throw new HutchError('not_found', `template source ${from} does not exist`);
  if (st.isDirectory()) {
    if (existsSync(join(from, 'oci-layout')) && existsSync(join(from, 'index.json'))) return ociSource(from);
    opts.log(`tarring directory ${from}`);
    const tar = join(opts.work, 'source.tar');
    // No --dereference: symlinks stay links (resolved inside the VM's root, never on the host).
    await run(['tar', '-C', from, '--sort=name', '--numeric-owner', '--one-file-system', '-cf', tar, '.']);
    return { info: { kind: 'dir', ref: from, digest: await sha256File(tar) }, layers: [await tarballLayer(tar, false)] };
  }
  if (!st.isFile()) throw new HutchError('bad_request', `template source ${from} is neither a file nor a directory`);
  const layer = await tarballLayer(from, false);
  return { info: { kind: 'tarball', ref: from, digest: await sha256File(from) }, layers: [layer] };
}
