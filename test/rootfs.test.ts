/**
 * The guest rootfs, for real: build it (or take it from ~/.cache/hutch), boot
 * it once under QEMU microvm (TCG) with the hutch kernel (or Debian's
 * fallback), and check through the agent alone what the broker relies on.
 * QEMU is always killed (and dies with this process anyway: pdeathsig).
 */
import { execFileSync } from 'node:child_process';
import { mkdir, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { AgentClient } from '../host-broker/src/agent-client.ts';
import { makeReproducibleExt4 } from '../rootfs/ext4.ts';
import { DIRTY_CHECK, gatherFacts, sh, timeTwice, type GuestFacts } from '../rootfs/guest-facts.ts';
import { ensureRootfs, type RootfsImage } from '../rootfs/image.ts';
import { ensureAgentLayer } from '../rootfs/agent-layer.ts';
import { missingRootTools } from './helpers/prerequisites.ts';
import { bootRootfs, findGuestKernel, type BootedVm, type GuestKernel } from '../rootfs/qemu-boot.ts';

const missing = missingRootTools(['qemu-system-x86_64', 'debootstrap', 'mke2fs', 'setpriv'], 'building the rootfs needs root (debootstrap, chroot)');
if (missing) console.warn(`SKIPPING test/rootfs.test.ts: ${missing}`);

describe.skipIf(missing !== undefined)('guest rootfs booted under QEMU (TCG)', { tags: ['vm'] }, () => {
  let rootfs: RootfsImage;
  let kernel: GuestKernel;
  let vm: BootedVm | undefined;
  let client: AgentClient | undefined;
  let agentPid = -1;
  let facts: GuestFacts;
  const warnings: string[] = [];

  beforeAll(async () => {
    // A cold cache builds the Debian base (minutes); afterwards this is seconds.
    rootfs = await ensureRootfs({ log: (m) => console.log(`[rootfs] ${m}`) });
    const layer = await ensureAgentLayer({ log: (m) => console.log(`[agent layer] ${m}`) });
    kernel = await findGuestKernel((m) => console.log(`[kernel] ${m}`));
    vm = await bootRootfs({
      image: rootfs.image,
      agentLayer: layer.image,
      kernel,
      readyTimeoutMs: 180_000,
      onConsole: (l) => {
        if (l.startsWith('HUTCH_WARN')) warnings.push(l);
      },
    });
    console.log(`[rootfs] ${kernel.description}: HUTCH_READY ${(vm.readyMs / 1000).toFixed(1)} s after QEMU start (guest uptime ${vm.readyUptime} s)`);
    client = await AgentClient.connectUnix(vm.agentSocket, { handshakeTimeoutMs: 60_000 });
    agentPid = Number(client.capabilities['pid']);
    // Python's first run right after boot, then again (timings are reported, never asserted).
    const py = await timeTwice(client, "python3 -c 'import json,unittest'");
    console.log(`[rootfs] python3 -c 'import json,unittest': first ${py.first} s, second ${py.second} s (in the guest, TCG)`);
    facts = await gatherFacts(client, agentPid);
  }, 30 * 60_000);

  afterAll(async () => {
    client?.close();
    await vm?.kill();
    if (vm) {
      // Nothing of QEMU may outlive the suite.
      const { code, signal } = await vm.exited;
      expect(code !== null || signal !== null).toBe(true);
    }
  }, 60_000);

  it('boots without warnings from init', () => {
    expect(warnings).toEqual([]);
  });

  it('runs tenant commands as uid 1000 with python3 and node', () => {
    expect(facts.uid).toBe(1000);
    expect(facts.idLine).toMatch(/^uid=1000\(tenant\) gid=1000\(tenant\)/);
    expect(facts.pythonOut).toBe('1');
    expect(facts.nodeOut).toBe('2');
  });

  it('has an overlay root with /work and /tmp as separate tmpfs mounts', () => {
    expect(facts.rootFsType).toBe('overlayfs');
    expect(facts.workFsType).toBe('tmpfs');
    expect(facts.tmpFsType).toBe('tmpfs');
  });

  it('stays clean after writes to /work and /tmp, and is dirty after a write to ~', () => {
    expect(facts.upperAtStart).toEqual([]);
    expect(facts.upperAfterWorkAndTmp).toEqual([]);
    expect(facts.upperAfterHome).toEqual(['home']);
  });

  it('lets the tenant write /etc only through permissions, not a read-only root', () => {
    expect(facts.etcWriteError).toMatch(/Permission denied/);
    expect(facts.etcWriteError).not.toMatch(/Read-only/);
  });

  it('has swap on the spare disk and zswap on', () => {
    // vda is the agent layer, vdb the template's root, vdc the spare disk.
    expect(facts.swaps).toEqual(['/dev/vdc']);
    expect(facts.zswap.enabled).toBe('Y');
    expect(facts.zswap.zpool).toBe('zsmalloc');
    expect(['lz4', 'lzo', 'lzo-rle']).toContain(facts.zswap.compressor);
  });

  it('sets up cgroup v2 with the agent in its own group and a workload group with a process cap from the VM size', () => {
    expect(facts.cgroupSubtreeControl).toEqual(expect.arrayContaining(['memory', 'pids']));
    // init derives the workload's process cap from the VM's memory: one per 512 KiB, 64..4096.
    const derived = String(Math.min(4096, Math.max(64, Math.floor(facts.memTotalKiB / 512))));
    expect(facts.workloadPidsMax).toBe(derived);
    expect(facts.agentCgroup).toBe('0::/agent');
    // Tenant processes are capped per uid even before the agent moves them to /workload.
    expect(facts.nprocLimit).toBe(derived);
  });

  it("keeps the agent's channel and process out of the tenant's reach", () => {
    expect(facts.vportModes.length).toBeGreaterThan(0);
    for (const m of facts.vportModes) expect(m).toBe('600');
    expect(facts.vportOpenError).toMatch(/Permission denied/);
    expect(facts.killAgentError).toMatch(/Operation not permitted/);
  });

  it("runs the agent on the agent layer's Node, read-only at /opt/hutch, apart from the template's own", async () => {
    if (!client) throw new Error('no VM');
    // The agent process is the layer's loader running the layer's node binary.
    const agentCmd = await sh(client, `tr '\\0' ' ' < /proc/${agentPid}/cmdline`);
    expect(agentCmd).toMatch(/^\/opt\/hutch\/lib\/ld-linux-x86-64\.so\.2 --library-path \/opt\/hutch\/lib \/opt\/hutch\/libexec\/node \/opt\/hutch\/hutch-agent\.mjs /);
    expect(await sh(client, 'touch /opt/hutch/x 2>&1 || true')).toMatch(/Read-only file system|Permission denied/);
    // The template's node is its own (Debian's /usr/bin/node), found first on the tenant's PATH.
    expect((await sh(client, 'command -v node')).trim()).toBe('/usr/bin/node');
  });

  it('serves a new broker connection after the previous one went away', async () => {
    if (!vm || !client) throw new Error('no VM');
    client.close();
    client = undefined;
    // The agent sees the host side detach, releases the port and waits for the next broker.
    await new Promise((r) => setTimeout(r, 500));
    client = await AgentClient.connectUnix(vm.agentSocket, { handshakeTimeoutMs: 60_000 });
    expect(Number(client.capabilities['pid'])).toBe(agentPid);
    expect(await sh(client, 'cat /work/hutch-facts/written-by-fs-write.txt')).toBe('via the agent\n');
    // The tenant's home write from before is still the only thing in the overlay.
    expect((await sh(client, DIRTY_CHECK)).trim()).toBe('home');
  }, 120_000);
});

describe.skipIf(missing !== undefined)('reproducible ext4 images', () => {
  it('gives identical bytes for the same tree created at different times', async () => {
    const work = await mkdtemp('/dev/shm/hutch-ext4-test-');
    try {
      const make = async (n: number): Promise<Buffer> => {
        // A fresh tree each time: new inodes, new ctimes, same content and creation order.
        const tree = path.join(work, `tree-${n}`);
        await mkdir(path.join(tree, 'etc/sub'), { recursive: true });
        await writeFile(path.join(tree, 'etc/a.conf'), 'a=1\n');
        await writeFile(path.join(tree, 'etc/sub/b'), Buffer.alloc(20_000, 7));
        execFileSync('touch', ['-h', '-d', '@1704067200', path.join(tree, 'etc/a.conf'), path.join(tree, 'etc/sub/b'), path.join(tree, 'etc/sub'), path.join(tree, 'etc'), tree]);
        const out = path.join(work, `img-${n}.ext4`);
        await makeReproducibleExt4({ dir: tree, out, epoch: 1704067200, uuid: '2b1c7d38-52b0-4b52-8f4e-6a0d3c2e1f10', label: 'repro' });
        return readFile(out);
      };
      const a = await make(1);
      await new Promise((r) => setTimeout(r, 1100)); // ctimes of the second tree differ by >= 1 s
      const b = await make(2);
      expect(a.length).toBeGreaterThan(0);
      expect(a.equals(b)).toBe(true);
    } finally {
      await rm(work, { recursive: true, force: true });
    }
  }, 120_000);
});
