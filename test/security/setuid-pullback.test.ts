import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { execFileSync } from 'node:child_process';
import { chmodSync, copyFileSync, existsSync, lstatSync, mkdirSync, mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Workspace } from '../../guest-agent/src/workspace/confine.ts';
import { WorkspaceMirror } from '../../host-broker/src/sync/workspace-mirror.ts';
import { startAgent, type AgentProcess } from '../helpers/agent-process.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';
import type { Hutch } from '../../host-broker/src/sdk/index.ts';

/**
 * Issue 12 item 3: a tenant's `cp /bin/bash /work/rootsh && chmod 4755 /work/rootsh` in a
 * VM came back to the host as a root-owned setuid binary. Nothing a tenant makes may become
 * setuid, setgid, a device node, a FIFO or a socket on the host through the pull-back.
 */
const SPECIAL_BITS = 0o7000;

describe('pull-back never makes setuid/setgid/sticky entries or special files on the host', () => {
  let agent: AgentProcess;
  let dir: string;
  let root: string;
  let mirror: WorkspaceMirror;
  beforeAll(async () => {
    agent = await startAgent();
    dir = mkdtempSync(join(tmpdir(), 'hutch-setuid-'));
    root = join(dir, 'workspace');
    mkdirSync(root);
    mkdirSync(join(dir, 'state'));
    mirror = new WorkspaceMirror(new Workspace(root), undefined, { stateDir: join(dir, 'state') });
    await mirror.push(agent.client);
  });
  afterAll(async () => {
    await agent.stop();
    rmSync(dir, { recursive: true, force: true });
  });

  it('masks file and directory modes to permission bits, created or changed', async () => {
    const { marker } = await agent.client.call('sync.mark', {});
    // The guest side of the pull is the agent's workspace: what a tenant could leave there as root in its VM.
    copyFileSync('/bin/bash', join(agent.root, 'rootsh'));
    chmodSync(join(agent.root, 'rootsh'), 0o4755);
    copyFileSync('/bin/bash', join(agent.root, 'groupsh'));
    chmodSync(join(agent.root, 'groupsh'), 0o2755);
    mkdirSync(join(agent.root, 'shared'));
    chmodSync(join(agent.root, 'shared'), 0o3777);
    const r = await mirror.pull(agent.client, marker, 64 * 1024 * 1024);
    expect(r.stats.errors).toEqual([]);
    expect(lstatSync(join(root, 'rootsh')).mode & 0o7777).toBe(0o755);
    expect(lstatSync(join(root, 'groupsh')).mode & 0o7777).toBe(0o755);
    expect(lstatSync(join(root, 'shared')).mode & 0o7777).toBe(0o777);

    // A mode change alone (same content) is masked too.
    const m2 = await agent.client.call('sync.mark', {});
    chmodSync(join(agent.root, 'shared'), 0o1777);
    chmodSync(join(agent.root, 'rootsh'), 0o6777);
    const r2 = await mirror.pull(agent.client, m2.marker, 64 * 1024 * 1024);
    expect(r2.stats.errors).toEqual([]);
    expect(lstatSync(join(root, 'rootsh')).mode & SPECIAL_BITS).toBe(0);
    expect(lstatSync(join(root, 'shared')).mode & SPECIAL_BITS).toBe(0);
  });

  it('refuses FIFOs, sockets and device nodes with a typed error and creates none of them', async () => {
    const { marker } = await agent.client.call('sync.mark', {});
    execFileSync('mkfifo', [join(agent.root, 'fifo')]);
    execFileSync('mknod', [join(agent.root, 'null-dev'), 'c', '1', '3']);
    execFileSync('python3', ['-c', `import socket; s = socket.socket(socket.AF_UNIX); s.bind(${JSON.stringify(join(agent.root, 'sock'))})`]);
    const r = await mirror.pull(agent.client, marker, 64 * 1024 * 1024);
    expect(r.stats.errors.map((e) => [e.path, e.code]).sort()).toEqual([
      ['fifo', 'unsupported_file_type'],
      ['null-dev', 'unsupported_file_type'],
      ['sock', 'unsupported_file_type'],
    ]);
    for (const n of ['fifo', 'null-dev', 'sock']) expect(existsSync(join(root, n))).toBe(false);
    for (const n of readdirSync(root)) {
      const st = lstatSync(join(root, n));
      expect(st.isFile() || st.isDirectory() || st.isSymbolicLink()).toBe(true);
    }
  });
});

describe('setuid through the pull-back, in a real VM', { tags: ['vm'] }, () => {
  let b: TestBroker;
  let hutch: Hutch;
  beforeAll(async () => {
    b = await startBroker({ backend: 'qemu' });
    hutch = await b.connect();
  }, 1_800_000);
  afterAll(async () => {
    await b?.stop();
  });

  it('cp /bin/bash /work/rootsh && chmod 4755 /work/rootsh leaves no setuid bit on the host copy', async () => {
    const sb = await hutch.create({ workspace: { files: { 'a.txt': 'x\n' } } });
    const r = await sb.run('cp /bin/bash /work/rootsh && chmod 4755 /work/rootsh && mkdir /work/sg && chmod 3777 /work/sg && mkfifo /work/pipe && stat -c %a /work/rootsh', { route: 'vm' });
    expect(r.route).toBe('vm');
    expect(r.exitCode).toBe(0);
    expect(r.stdout).toBe('4755\n'); // the guest did make it setuid
    const ws = join(b.dataDir, 'sessions', sb.id, 'workspace');
    const st = lstatSync(join(ws, 'rootsh'));
    expect(st.isFile()).toBe(true);
    expect(st.mode & SPECIAL_BITS).toBe(0);
    expect(st.mode & 0o777).toBe(0o755);
    expect(lstatSync(join(ws, 'sg')).mode & SPECIAL_BITS).toBe(0);
    expect(existsSync(join(ws, 'pipe'))).toBe(false);
    // What was not carried is on the call's result, typed.
    expect(r.syncErrors?.map((e) => [e.path, e.code])).toEqual([['pipe', 'unsupported_file_type']]);
    await sb.close();
  }, 900_000);
});
