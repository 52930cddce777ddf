import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Workspace } from '../../guest-agent/src/workspace/confine.ts';
import { FileTools } from '../../guest-agent/src/workspace/file-tools.ts';
import { nameFromBytes } from '../../guest-agent/src/workspace/names.ts';
import { walk } from '../../guest-agent/src/workspace/walk.ts';

/**
 * Issue 12 item 2: a leftover tenant process swaps a workspace directory with a symlink to
 * a host directory (renameat2 RENAME_EXCHANGE in a tight loop) while the in-process file
 * tools run. Nothing outside the workspace may be created, read, changed or removed.
 * Before the tools resolved by directory fds, write('dd/x') landed in the host directory
 * and grep returned the host file's lines within a few hundred calls.
 */

const base = mkdtempSync(join(tmpdir(), 'hutch-race-'));
const host = join(base, 'host');
const root = join(base, 'ws');
const HOST_NAMES = ['inside.txt', 'sub', 'victim.txt'];
let swapper: ChildProcess | undefined;

// The attacker: exchanges ws/dd (a real directory) and ws/swap (a symlink to the host
// directory) as fast as it can, through the real renameat2 syscall.
const SWAPPER = `
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
a, b = os.fsencode(sys.argv[1]), os.fsencode(sys.argv[2])
sys.stdout.write('ready\\n'); sys.stdout.flush()
while True:
    if libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) != 0:
        sys.exit('renameat2: errno %d' % ctypes.get_errno())
`;

beforeAll(async () => {
  mkdirSync(join(host, 'sub'), { recursive: true });
  writeFileSync(join(host, 'inside.txt'), 'HOST SECRET\n');
  writeFileSync(join(host, 'victim.txt'), 'HOST SECRET victim\n');
  writeFileSync(join(host, 'sub', 'victim2.txt'), 'HOST SECRET victim2\n');
  mkdirSync(join(root, 'dd', 'keep'), { recursive: true });
  writeFileSync(join(root, 'dd', 'inside.txt'), 'inside\n');
  symlinkSync(host, join(root, 'swap'));
  swapper = spawn('python3', ['-c', SWAPPER, join(root, 'dd'), join(root, 'swap')], { stdio: ['ignore', 'pipe', 'inherit'] });
  await new Promise<void>((resolve, reject) => {
    swapper?.stdout?.once('data', () => resolve());
    swapper?.once('exit', (code) => reject(new Error(`swapper exited ${code}`)));
  });
});

afterAll(() => {
  swapper?.kill('SIGKILL');
  rmSync(base, { recursive: true, force: true });
});

function hostUntouched(): void {
  expect(readdirSync(host).sort()).toEqual(HOST_NAMES);
  expect(readdirSync(join(host, 'sub'))).toEqual(['victim2.txt']);
  expect(readFileSync(join(host, 'inside.txt'), 'utf8')).toBe('HOST SECRET\n');
  expect(readFileSync(join(host, 'victim.txt'), 'utf8')).toBe('HOST SECRET victim\n');
}

describe('a directory swapped for a symlink to the host mid-call', () => {
  it('never lets a tool create, read, change or remove anything outside the workspace', async () => {
    const tools = new FileTools(new Workspace(root));
    const leaked: string[] = [];
    const ok: Record<string, number> = {};
    const attempt = async (name: string, p: Promise<unknown>) => {
      try {
        const r = await p;
        ok[name] = (ok[name] ?? 0) + 1;
        const text = JSON.stringify(r);
        if (text.includes('HOST SECRET') || text.includes('victim')) leaked.push(`${name}: ${text.slice(0, 200)}`);
      } catch (err) {
        // Refusals are fine (outside_workspace when the symlink is seen, not_found...), as
        // long as they are typed; what must never happen is an effect outside.
        expect((err as { code?: string }).code, `${name}: ${(err as Error).message}`).toMatch(/^[a-z_]+$/);
      }
    };
    for (let i = 0; i < 200; i++) {
      await attempt('write', tools.write({ path: `dd/x${i % 7}`, content: 'written' }));
      await attempt('read', tools.read({ path: 'dd/inside.txt' }));
      await attempt('edit', tools.edit({ path: 'dd/inside.txt', oldString: 'inside', newString: 'inside' + (i % 2 ? '' : '!'), replaceAll: true }));
      await attempt('grep', tools.grep({ pattern: 'SECRET|inside' }));
      await attempt('grep-dd', tools.grep({ pattern: '.', path: 'dd' }));
      await attempt('list', tools.list({ path: 'dd' }));
      await attempt('glob', tools.glob({ pattern: '**/*' }));
      await attempt('mkdir', tools.mkdir({ path: `dd/keep/m${i}`, parents: true }));
      await attempt('remove-file', tools.remove({ path: 'dd/victim.txt' }));
      await attempt('remove-tree', tools.remove({ path: 'dd/sub', recursive: true }));
      await attempt('remove-own', tools.remove({ path: `dd/keep/m${i}`, recursive: true }));
      await attempt('move-out', tools.move({ from: 'dd/victim.txt', to: `stolen${i}` }));
      await attempt('move-in', tools.move({ from: `dd/x${i % 7}`, to: `dd/keep/y${i % 7}`, overwrite: true }));
      if (i % 50 === 0) hostUntouched();
    }
    expect(leaked).toEqual([]);
    hostUntouched();
    // Nothing was stolen into the workspace either, and the race really was exercised:
    // each tool got through often enough.
    expect(readdirSync(root).filter((n) => n.startsWith('stolen'))).toEqual([]);
    for (const name of ['write', 'read', 'grep', 'list', 'glob', 'mkdir', 'move-in']) expect(ok[name] ?? 0, name).toBeGreaterThan(5);
    expect(existsSync(join(host, 'x0'))).toBe(false);
  });

  it('walk by fds never descends into the host directory', async () => {
    for (let i = 0; i < 300; i++) {
      for await (const e of walk(root)) {
        expect(e.rel).not.toMatch(/victim/);
      }
    }
  });
});

describe('names that are not UTF-8', () => {
  it('are listed, read, searched and written through the tools, byte for byte', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'hutch-rawnames-'));
    try {
      const bad = Buffer.from([0x62, 0x61, 0x64, 0xfe]); // "bad\xfe"
      writeFileSync(Buffer.concat([Buffer.from(`${dir}/`), bad]), 'odd content\n');
      const tools = new FileTools(new Workspace(dir));
      const name = nameFromBytes(bad);
      expect(name).toBe('bad\udcfe');
      expect((await tools.list({})).entries).toEqual([{ path: name, type: 'file' }]);
      expect((await tools.read({ path: name, numbered: false })).content).toBe('odd content');
      expect((await tools.grep({ pattern: 'odd' })).matches).toEqual([{ path: name, line: 1, text: 'odd content' }]);
      expect((await tools.glob({ pattern: 'bad*' })).files).toEqual([name]);
      await tools.edit({ path: name, oldString: 'odd', newString: 'even' });
      await tools.write({ path: `sub\udcff/${name}`, content: 'new' });
      const sub = Buffer.concat([Buffer.from(`${dir}/sub`), Buffer.from([0xff])]);
      expect(readdirSync(sub, { encoding: 'buffer' })).toEqual([bad]);
      expect(readFileSync(Buffer.concat([sub, Buffer.from('/'), bad]), 'utf8')).toBe('new');
      expect(readFileSync(Buffer.concat([Buffer.from(`${dir}/`), bad]), 'utf8')).toBe('even content\n');
      const walked: Buffer[] = [];
      for await (const e of walk(dir)) walked.push(e.raw);
      expect(walked.map((b) => b.toString('hex')).sort()).toEqual([bad, Buffer.from('sub\xff', 'latin1'), Buffer.concat([Buffer.from('sub\xff/', 'latin1'), bad])].map((b) => b.toString('hex')).sort());
      await tools.move({ from: name, to: 'plain' });
      expect(readFileSync(join(dir, 'plain'), 'utf8')).toBe('even content\n');
      await tools.remove({ path: `sub\udcff`, recursive: true });
      expect(readdirSync(dir)).toEqual(['plain']);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
