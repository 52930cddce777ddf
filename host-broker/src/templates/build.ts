/**
 * `hutch template build NAME --from SOURCE [--packages a,b] [--run STEP]... [--env K=V]...
 * [--workdir DIR] [--start CMD] [--memory MIB] [--cpus N]`.
 *
 * 1. SOURCE becomes layers (sources.ts): only read on the host, never unpacked there.
 * 2. A throwaway microVM boots hutch's agent layer in build mode (rootfs/guest/build.sh):
 *    it unpacks the layers onto an empty ext4 disk the host made, adds the tenant user and
 *    mount points, runs the --run steps as root inside the image, checks what a template
 *    root must provide, and powers off. When there are --run steps, the VM's one NIC reaches
 *    nothing but egress-proxy.ts (HTTP/HTTPS proxy; never the host itself): steps that
 *    download (apt-get, pip, curl, git over https) work as on the build host.
 * 3. A VM boots from the result (the start command runs before the agent) and its pristine
 *    snapshot is taken; then the build is published under its content address and NAME
 *    points at it. Same inputs, same id: nothing is rebuilt (unless --force).
 */
import { randomBytes } from 'node:crypto';
import { createReadStream, createWriteStream, mkdirSync, mkdtempSync, readdirSync, renameSync, rmSync, statSync, writeFileSync, chmodSync, truncateSync, existsSync } from 'node:fs';
import { join } from 'node:path';
import { tmpdir } from 'node:os';
import { pipeline } from 'node:stream/promises';
import { fileURLToPath } from 'node:url';
import { performance } from 'node:perf_hooks';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { createLogger } from '../../../guest-agent/src/log.ts';
import { hashInputs } from '../../../build/cache.ts';
import { run } from '../../../build/run.ts';
import { hostTscKhz } from '../../../kernel-configs/boot-params.ts';
import { chooseAccel } from '../vm/accel.ts';
import { ensureGuestBase, withTemplateRoot, type GuestBase, type KernelChoice } from '../vm/guest-image.ts';
import { QemuDriver } from '../vm/qemu-driver.ts';
import { SnapshotStore } from '../vm/snapshot-store.ts';
import { parseCidr, startEgressProxy, type EgressProxy } from './egress-proxy.ts';
import { prepareSource, type SourceLayer } from './sources.ts';
import { TemplateStore, validateTemplateName, DEFAULT_TEMPLATE, type TemplateManifest } from './store.ts';

const HERE = fileURLToPath(new URL('.', import.meta.url));
/**
 * What shapes a build besides its inputs: the in-VM builder script and the host side's
 * format (bump BUILD_FORMAT when a change to this code or sources.ts changes what a build
 * produces; edits that do not, such as logging, then do not rebuild every template).
 */
const BUILDER_FILES = [join(HERE, '../../../rootfs/guest/build.sh')];
const BUILD_FORMAT = '2';
/** Where the build VM sees its egress proxy (inside QEMU's user network, 10.0.2.0/24). */
const EGRESS_ADDRESS = '10.0.2.100';
const EGRESS_PORT = 3128;
const MiB = 1024 * 1024;
/** Swap the pristine snapshot is taken with: the qemu backend's default (a slot restores into the same layout). */
export const TEMPLATE_SWAP_MIB = 512;

export interface TemplateBuildOptions {
  name: string;
  from: string;
  packages?: string[];
  run?: string[];
  env?: Record<string, string>;
  workdir?: string;
  start?: string;
  memoryMiB?: number;
  cpus?: number;
  dataDir: string;
  cacheDir: string;
  kernel?: KernelChoice;
  force?: boolean;
  /** The build VM's whole life (unpack + steps); default 30 min. */
  timeoutMs?: number;
  /** false: --run steps get no network at all (default: through the egress proxy). */
  network?: boolean;
  /** Private ranges (CIDR) the steps may reach through the egress proxy, e.g. a LAN mirror. */
  egressAllow?: readonly string[];
  log?: (line: string) => void;
}

export interface TemplateBuildResult {
  manifest: TemplateManifest;
  cached: boolean;
  dir: string;
  /** Wall seconds of this call. */
  seconds: number;
  snapshot: { key: string; bytes: number; bootMs: number };
}

function parseEnv(env: Record<string, string>): string {
  let out = '';
  for (const [k, v] of Object.entries(env)) {
    if (!/^[A-Za-z_][A-Za-z0-9_]*$/.test(k)) throw new HutchError('bad_request', `--env: ${JSON.stringify(k)} is not a variable name`);
    if (/[\n\0]/.test(v)) throw new HutchError('bad_request', `--env ${k}: the value may not hold a newline or NUL`);
    out += `${k}=${v}\n`;
  }
  return out;
}

/** The build spec tar (guest/build.sh reads it from the input disk's start). */
async function writeSpec(work: string, layers: { offset: number; layer: SourceLayer }[], o: Required<Pick<TemplateBuildOptions, 'run' | 'env' | 'workdir'>> & { start?: string }): Promise<string> {
  const dir = join(work, 'spec');
  mkdirSync(join(dir, 'steps'), { recursive: true });
  writeFileSync(join(dir, 'spec'), layers.map(({ offset, layer }) => `layer ${offset} ${layer.bytes} ${layer.compression} ${layer.whiteouts ? 'oci' : 'plain'}\n`).join(''));
  o.run.forEach((step, i) => writeFileSync(join(dir, 'steps', String(i + 1)), `${step}\n`));
  writeFileSync(join(dir, 'env'), parseEnv(o.env));
  writeFileSync(join(dir, 'workdir'), `${o.workdir}\n`);
  if (o.start !== undefined) writeFileSync(join(dir, 'start'), `${o.start}\n`);
  const tar = join(work, 'spec.tar');
  await run(['tar', '-C', dir, '--numeric-owner', '--owner=0', '--group=0', '-cf', tar, '.']);
  return tar;
}

/** The input disk: the spec tar at 0, each layer at the next MiB boundary (sparse gaps). */
async function writeInputDisk(work: string, layers: SourceLayer[], o: Parameters<typeof writeSpec>[2]): Promise<{ file: string; specBytes: number }> {
  // Offsets depend on the spec's size, which depends on the offsets' digits: reserve 1 MiB for it.
  let offset = MiB;
  const placed = layers.map((layer) => {
    const p = { offset, layer };
    offset += Math.ceil(layer.bytes / MiB) * MiB || MiB;
    return p;
  });
  const spec = await writeSpec(work, placed, o);
  const specBytes = statSync(spec).size;
  if (specBytes > MiB) throw new HutchError('too_large', `the build spec is ${specBytes} bytes (--run steps, --env, --start): at most 1 MiB`);
  const file = join(work, 'input.img');
  await pipeline(createReadStream(spec), createWriteStream(file));
  for (const { offset: at, layer } of placed) await pipeline(createReadStream(layer.file), createWriteStream(file, { flags: 'r+', start: at }));
  truncateSync(file, offset);
  return { file, specBytes };
}

function consoleRelay(log: (l: string) => void): { onLine: (l: string) => void; verdict: () => string | undefined } {
  let verdict: string | undefined;
  let inSteps = false;
  // A step's output is relayed, up to a bound: a step printing without end fills no log.
  let relayed = 0;
  const MAX_RELAYED = 5000;
  // HUTCH_TEMPLATE_DEBUG=1: the build VM's whole console (kernel, init, build.sh).
  const all = process.env['HUTCH_TEMPLATE_DEBUG'] === '1';
  return {
    onLine: (raw) => {
      const l = raw.replace(/\r$/, '');
      if (all) log(`  console: ${l}`);
      if (/^HUTCH_BUILD_(OK|REFUSED|FAILED)/.test(l)) verdict = l;
      else if (l.startsWith('HUTCH_BUILD_STEP ')) {
        inSteps = true;
        log(`run step ${l.slice('HUTCH_BUILD_STEP '.length)}`);
      } else if (l.startsWith('hutch-build: ')) {
        inSteps = false;
        log(l.slice('hutch-build: '.length));
      } else if (inSteps && !l.startsWith('hutch-init:')) {
        if (++relayed <= MAX_RELAYED) log(`  | ${l}`);
        else if (relayed === MAX_RELAYED + 1) log(`  | (further step output not shown: more than ${MAX_RELAYED} lines)`);
      }
    },
    verdict: () => verdict,
  };
}

export function templateDriver(accel: { accel: 'kvm' | 'tcg' }, tscKhz: number | undefined): QemuDriver {
  return new QemuDriver({ accel: accel.accel, log: createLogger({ name: 'hutch-template', level: 'warn' }), ...(tscKhz ? { tscKhz } : {}) });
}

export async function buildTemplate(o: TemplateBuildOptions): Promise<TemplateBuildResult> {
  const t0 = performance.now();
  const log = o.log ?? ((l: string) => process.stderr.write(`template: ${l}\n`));
  const name = validateTemplateName(o.name);
  if (name === DEFAULT_TEMPLATE) throw new HutchError('bad_request', `"${DEFAULT_TEMPLATE}" is hutch's own template (built by ./hutch setup); pick another name`);
  if (process.getuid?.() !== 0) throw new HutchError('unavailable', 'building a template needs root (QEMU, the agent layer, debootstrap)');
  const steps = o.run ?? [];
  const env = o.env ?? {};
  const workdir = o.workdir ?? '/';
  if (!workdir.startsWith('/') || /[\n\0]/.test(workdir)) throw new HutchError('bad_request', `--workdir must be an absolute path, got ${JSON.stringify(workdir)}`);
  if (o.start !== undefined && /\0/.test(o.start)) throw new HutchError('bad_request', '--start may not hold a NUL byte');
  for (const s of steps) if (/\0/.test(s)) throw new HutchError('bad_request', '--run steps may not hold a NUL byte');
  const memoryMiB = o.memoryMiB ?? 512;
  const cpus = o.cpus ?? 1;
  if (!Number.isInteger(memoryMiB) || memoryMiB < 128 || memoryMiB > 64 * 1024) throw new HutchError('bad_request', `--memory ${memoryMiB}: 128..65536 MiB`);
  if (!Number.isInteger(cpus) || cpus < 1 || cpus > 16) throw new HutchError('bad_request', `--cpus ${cpus}: 1..16`);

  const network = o.network ?? true;
  const egressAllow = o.egressAllow ?? [];
  if (!network && egressAllow.length > 0) throw new HutchError('bad_request', `template ${name}: --egress-allow and --offline contradict each other`, { template: name });
  for (const c of egressAllow) parseCidr(c);
  const store = new TemplateStore(o.dataDir);
  mkdirSync(join(store.root, 'by-id'), { recursive: true });
  let egress: EgressProxy | undefined;
  let egressDir: string | undefined;
  const work = join(store.root, `.build-${process.pid}-${randomBytes(4).toString('hex')}`);
  mkdirSync(work, { recursive: true, mode: 0o700 });
  chmodSync(work, 0o700);
  try {
    const source = await prepareSource(o.from, { ...(o.packages ? { packages: o.packages } : {}), work, log });
    const id = await hashInputs(
      [
        { label: 'source', value: `${source.info.kind}:${source.info.digest}` },
        { label: 'run', value: JSON.stringify(steps) },
        { label: 'env', value: JSON.stringify(env) },
        { label: 'workdir', value: workdir },
        { label: 'start', value: JSON.stringify(o.start ?? null) },
        { label: 'size', value: `${memoryMiB}/${cpus}` },
        // Offline steps may build something else than the same steps with the network.
        ...(network ? [] : [{ label: 'network', value: 'off' }]),
        { label: 'format', value: BUILD_FORMAT },
        ...BUILDER_FILES.map((file) => ({ file })),
      ],
      24,
    );
    const builder = await hashInputs([{ label: 'format', value: BUILD_FORMAT }, ...BUILDER_FILES.map((file) => ({ file }))]);
    const base = await ensureGuestBase({ ...(o.kernel ? { kernel: o.kernel } : {}), log });
    const accel = await chooseAccel(base.kernel, { cacheDir: o.cacheDir, log: createLogger({ name: 'hutch-template', level: 'warn' }) });
    const tsc = accel.accel === 'tcg' ? (await hostTscKhz()).khz : undefined;
    const driver = templateDriver(accel, tsc);
    const size = { memoryMiB, cpus, swapMiB: TEMPLATE_SWAP_MIB };

    const existing = o.force ? undefined : store.readBuild(id);
    if (existing) {
      log(`${name}: inputs unchanged, build ${id} reused`);
      const snap = await pristineFor(store.byId(id), base, { rootfs: join(store.byId(id), 'rootfs.ext4'), id, name }, driver, size, log);
      store.setName(name, id);
      return { manifest: { ...existing, name }, cached: true, dir: store.byId(id), seconds: (performance.now() - t0) / 1000, snapshot: snap };
    }

    log(`${name}: building ${id} from ${source.info.kind} ${source.info.ref} (${source.layers.length} layer(s), ${steps.length} --run step(s))`);
    if (steps.length > 0 && !network) log('NOTE: --offline: --run steps have no network; steps that download will fail.');
    const input = await writeInputDisk(work, source.layers, { run: steps, env, workdir, ...(o.start !== undefined ? { start: o.start } : {}) });
    // The target: an empty ext4 made here (no tenant bytes in it yet), sparse; room for
    // the layers unpacked (gzip ~3x) and what the steps add.
    const layerBytes = source.layers.reduce((a, l) => a + l.bytes, 0);
    const targetMiB = Math.max(2048, Math.ceil((layerBytes * 4) / MiB) + 2048);
    const target = join(work, 'rootfs.ext4');
    await run(['mke2fs', '-q', '-F', '-t', 'ext4', '-O', '^has_journal', '-m', '0', '-L', 'hutch-template', target, `${targetMiB}M`]);

    const tb = performance.now();
    const relay = consoleRelay(log);
    // Only steps need the network; a build without them boots no NIC at all.
    if (network && steps.length > 0) {
      egressDir = mkdtempSync(join(tmpdir(), 'hutch-egress-'));
      egress = await startEgressProxy({ socketPath: join(egressDir, 'proxy.sock'), allow: egressAllow, log });
    }
    const vm = await driver.boot({
      id: `tpl-${id.slice(0, 8)}`,
      // Short: QEMU's Unix sockets live there (at most 107 bytes of path).
      dir: join(tmpdir(), `hutch-tpl-${id.slice(0, 8)}-${process.pid}`),
      image: {
        kernel: base.kernel,
        ...(base.initrd ? { initrd: base.initrd } : {}),
        flavor: base.flavor,
        agentLayer: base.agentLayer,
        rootfs: input.file,
        cmdline: ['hutch.mode=build', `hutch.build_spec_bytes=${input.specBytes}`, ...(egress ? [`hutch.build_egress=${EGRESS_ADDRESS}:${EGRESS_PORT}`] : [])],
      },
      ...(egress ? { egress: { proxySocket: egress.socketPath, proxyAddress: EGRESS_ADDRESS, proxyPort: EGRESS_PORT } } : {}),
      memoryMiB,
      cpus,
      swapMiB: 0,
      disks: [{ file: target, readonly: false }],
      onConsole: relay.onLine,
    });
    const timeoutMs = o.timeoutMs ?? 30 * 60_000;
    let timer: NodeJS.Timeout | undefined;
    const timedOut = new Promise<'timeout'>((r) => (timer = setTimeout(() => r('timeout'), timeoutMs)));
    const ended = await Promise.race([vm.exited, timedOut]);
    clearTimeout(timer);
    await vm.destroy();
    await egress?.close();
    egress = undefined;
    const verdict = relay.verdict();
    if (ended === 'timeout') throw new HutchError('timeout', `template ${name}: the build VM did not finish within ${timeoutMs / 1000} s`, { template: name });
    if (!verdict) throw new HutchError('internal', `template ${name}: the build VM ended without a verdict; console tail: ${ended.console.slice(-8).join(' | ')}`, { template: name });
    if (verdict.startsWith('HUTCH_BUILD_REFUSED')) {
      const missing = verdict.slice('HUTCH_BUILD_REFUSED '.length).split(',').filter(Boolean);
      throw new HutchError('unusable_rootfs', `${source.info.ref} cannot be a hutch template: its root filesystem lacks ${missing.join(', ')} (a template root needs /bin/sh, glibc's /lib64/ld-linux-x86-64.so.2 and bash)`, { template: name, missing });
    }
    if (!verdict.startsWith('HUTCH_BUILD_OK')) throw new HutchError('bad_request', `template ${name}: ${verdict.slice('HUTCH_BUILD_FAILED '.length)}`, { template: name });
    const buildSeconds = Math.round((performance.now() - tb) / 100) / 10;
    log(`${name}: root filesystem built in ${buildSeconds} s; booting it for the pristine snapshot`);

    // Published only complete: the snapshot is taken in the staging dir, then renamed.
    const staging = join(work, 'out');
    mkdirSync(staging);
    renameSync(target, join(staging, 'rootfs.ext4'));
    const ts = performance.now();
    const snap = await pristineFor(staging, base, { rootfs: join(staging, 'rootfs.ext4'), id, name }, driver, size, log);
    const st = statSync(join(staging, 'rootfs.ext4'));
    const manifest: TemplateManifest = {
      name,
      id,
      source: source.info,
      run: steps,
      env,
      workdir,
      ...(o.start !== undefined ? { start: o.start } : {}),
      memoryMiB,
      cpus,
      buildSeconds,
      snapshotSeconds: Math.round((performance.now() - ts) / 100) / 10,
      rootfsBytes: st.size,
      rootfsAllocatedBytes: st.blocks * 512,
      builtAt: new Date().toISOString(),
      builder,
    };
    writeFileSync(join(staging, 'manifest.json'), `${JSON.stringify(manifest, null, 2)}\n`);
    const final = store.byId(id);
    rmSync(final, { recursive: true, force: true });
    renameSync(staging, final);
    store.setName(name, id);
    log(`${name}: ready (${id}) in ${Math.round((performance.now() - t0) / 1000)} s`);
    return { manifest, cached: false, dir: final, seconds: (performance.now() - t0) / 1000, snapshot: snap };
  } finally {
    await egress?.close();
    if (egressDir) rmSync(egressDir, { recursive: true, force: true });
    rmSync(work, { recursive: true, force: true });
  }
}

/**
 * Every agent-layer change gives a template a new pristine snapshot (~120 MiB on disk): keep
 * the current one and the newest other (a broker still running the previous agent restores
 * from it); older ones, whose slots no current broker would restore anyway, go.
 */
function pruneSnapshots(root: string, current: string): void {
  const others = readdirSync(root, { withFileTypes: true })
    .filter((e) => e.isDirectory() && /^[0-9a-f]{24}$/.test(e.name) && e.name !== current)
    .map((e) => ({ name: e.name, mtime: statSync(join(root, e.name)).mtimeMs }))
    .sort((a, b) => b.mtime - a.mtime);
  for (const o of others.slice(1)) rmSync(join(root, o.name), { recursive: true, force: true });
}

/** The template's pristine snapshot for this kernel + agent layer + size (cached in its dir). */
async function pristineFor(
  dir: string,
  base: GuestBase,
  root: { rootfs: string; id: string; name: string },
  driver: QemuDriver,
  size: { memoryMiB: number; cpus: number; swapMiB: number },
  log: (l: string) => void,
): Promise<{ key: string; bytes: number; bootMs: number }> {
  const snapshots = new SnapshotStore(dir, driver, createLogger({ name: 'hutch-template', level: 'warn' }));
  const image = withTemplateRoot(base, root);
  const already = existsSync(join(dir, 'snapshots', snapshots.key(image, size), 'meta.json'));
  if (!already) log(`${root.name}: taking the pristine snapshot (${size.memoryMiB} MiB, ${size.cpus} vCPU)`);
  const p = await snapshots.pristine(image, size);
  pruneSnapshots(join(dir, 'snapshots'), p.meta.key);
  const bytes = TemplateStore.allocatedBytes(p.dir);
  return { key: p.meta.key, bytes, bootMs: p.meta.bootMs };
}
