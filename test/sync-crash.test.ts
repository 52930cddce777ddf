import { afterEach, describe, expect, it } from 'vitest';
import { spawn } from 'node:child_process';
import { cpSync, existsSync, mkdirSync, mkdtempSync, readdirSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Workspace } from '../guest-agent/src/workspace/confine.ts';
import { isAtomicTempName } from '../guest-agent/src/workspace/atomic-write.ts';
import { WorkspaceMirror } from '../host-broker/src/sync/workspace-mirror.ts';
import { recoverPullJournal } from '../host-broker/src/sync/pull-journal.ts';
import { startAgent, type AgentProcess } from './helpers/agent-process.ts';
import { treeDigest } from './helpers/tree-digest.ts';

const CHILD = join(import.meta.dirname, 'helpers', 'pull-child.ts');
const digest = (root: string) => treeDigest(root, (n) => isAtomicTempName(n.toString('latin1')));

/** Host workspace before the call: a few files, a directory the guest turns into a file, one the guest deletes. */
function seedHost(root: string): void {
  writeFileSync(join(root, 'keep.txt'), 'untouched\n');
  writeFileSync(join(root, 'edit.txt'), 'version 1\n');
  writeFileSync(join(root, 'gone.txt'), 'the guest deletes me\n');
  mkdirSync(join(root, 'was-dir'));
  writeFileSync(join(root, 'was-dir', 'child.txt'), 'child\n');
}

/** The call's changes in the guest: edits, a deletion, a kind change, a symlink and 2,000 new files. */
function changeGuest(root: string): void {
  writeFileSync(join(root, 'edit.txt'), 'version 2\n');
  rmSync(join(root, 'gone.txt'));
  rmSync(join(root, 'was-dir'), { recursive: true });
  writeFileSync(join(root, 'was-dir'), 'now a file\n');
  symlinkSync('keep.txt', join(root, 'link'));
  for (let d = 0; d < 20; d++) {
    mkdirSync(join(root, 'out', `d${d}`), { recursive: true });
    for (let f = 0; f < 100; f++) writeFileSync(join(root, 'out', `d${d}`, `f${f}.txt`), `${d}/${f}\n`);
  }
}

function runChild(args: string[]): Promise<{ line: string; kill: () => Promise<void> }> {
  const child = spawn(process.execPath, ['--import', 'tsx', CHILD, ...args], { stdio: ['ignore', 'pipe', 'pipe'] });
  let err = '';
  child.stderr.on('data', (d: Buffer) => (err += d.toString()));
  const exited = new Promise<void>((r) => child.once('exit', () => r()));
  return new Promise((resolve, reject) => {
    let out = '';
    child.stdout.on('data', (d: Buffer) => {
      out += d.toString();
      const line = out.split('\n')[0] as string;
      if (out.includes('\n')) resolve({ line, kill: async () => void (child.kill('SIGKILL'), await exited) });
    });
    child.once('exit', (code) => reject(new Error(`pull child exited (${code}) before its hook: ${err}`)));
  });
}

describe('a pull is atomic on the host: a broker killed mid-pull leaves before or after, never a mix', () => {
  const cleanup: Array<() => Promise<void> | void> = [];
  afterEach(async () => {
    for (const c of cleanup.splice(0)) await c();
  });

  async function setup(): Promise<{ agent: AgentProcess; root: string; stateDir: string; marker: string; before: string; after: string }> {
    const dir = mkdtempSync(join(tmpdir(), 'hutch-pull-crash-'));
    const root = join(dir, 'workspace');
    const stateDir = join(dir, 'state');
    mkdirSync(root);
    mkdirSync(stateDir);
    seedHost(root);
    const agent = await startAgent();
    cleanup.push(() => agent.stop(), () => rmSync(dir, { recursive: true, force: true }));
    await new WorkspaceMirror(new Workspace(root), undefined, { stateDir }).push(agent.client);
    const { marker } = await agent.client.call('sync.mark', {});
    const before = digest(root);
    expect(digest(agent.root)).toBe(before);
    changeGuest(agent.root);
    // After the pull the host holds exactly what the guest holds.
    return { agent, root, stateDir, marker, before, after: digest(agent.root) };
  }

  for (const [point, expected, after] of [
    ['staged', 'before', '0'],
    ['committed', 'after', '0'],
    ['applying', 'after', '1024'],
  ] as const) {
    it(`SIGKILL at ${point}: recovery leaves the workspace as it was ${expected} the call`, { timeout: 120_000 }, async () => {
      const s = await setup();
      const child = await runChild([s.agent.socket, s.root, s.stateDir, s.marker, point, after]);
      expect(child.line).toBe('HOOK');
      await child.kill();
      const atCrash = digest(s.root);
      if (point === 'applying') {
        // Killed halfway through the renames: without recovery the workspace is a mix.
        expect(atCrash).not.toBe(s.before);
        expect(atCrash).not.toBe(s.after);
      } else expect(atCrash).toBe(s.before);
      const r = recoverPullJournal(s.root, s.stateDir);
      expect(r.errors).toEqual([]);
      expect(r.replayed + r.discarded).toBe(1);
      expect(digest(s.root)).toBe(expected === 'before' ? s.before : s.after);
      expect(readdirSync(s.stateDir)).toEqual([]);
      // Replaying is idempotent: a second recovery (a crash during the first) changes nothing.
      expect(recoverPullJournal(s.root, s.stateDir)).toMatchObject({ replayed: 0, discarded: 0 });
      expect(digest(s.root)).toBe(expected === 'before' ? s.before : s.after);
    });
  }

  it('a committed journal replayed again over a finished or half-applied tree still ends at after', { timeout: 120_000 }, async () => {
    const s = await setup();
    const child = await runChild([s.agent.socket, s.root, s.stateDir, s.marker, 'applying', '512']);
    await child.kill();
    // Save the half-applied state with its journal, replay, restore it, replay again: same result.
    const copy = `${s.root}.copy`;
    const stateCopy = `${s.stateDir}.copy`;
    cpSync(s.root, copy, { recursive: true, verbatimSymlinks: true });
    cpSync(s.stateDir, stateCopy, { recursive: true, verbatimSymlinks: true });
    cleanup.push(() => rmSync(copy, { recursive: true, force: true }), () => rmSync(stateCopy, { recursive: true, force: true }));
    recoverPullJournal(s.root, s.stateDir);
    expect(digest(s.root)).toBe(s.after);
    // Killed after every rename but before the journal was removed: the journal is replayed over a finished tree.
    expect(existsSync(join(stateCopy, 'sync-pull', 'journal'))).toBe(true);
    rmSync(s.stateDir, { recursive: true });
    cpSync(stateCopy, s.stateDir, { recursive: true, verbatimSymlinks: true });
    expect(recoverPullJournal(s.root, s.stateDir)).toMatchObject({ replayed: 1, errors: [] });
    expect(digest(s.root)).toBe(s.after);
    // And from the half-applied copy again: the same end state.
    rmSync(s.root, { recursive: true });
    rmSync(s.stateDir, { recursive: true });
    cpSync(copy, s.root, { recursive: true, verbatimSymlinks: true });
    cpSync(stateCopy, s.stateDir, { recursive: true, verbatimSymlinks: true });
    recoverPullJournal(s.root, s.stateDir);
    expect(digest(s.root)).toBe(s.after);
  });

  it('an uninterrupted pull in a child process ends at after', { timeout: 120_000 }, async () => {
    const s = await setup();
    const child = await runChild([s.agent.socket, s.root, s.stateDir, s.marker, 'none', '0']);
    expect(child.line).toBe('DONE');
    await child.kill();
    expect(digest(s.root)).toBe(s.after);
  });
});
