import { afterEach, describe, expect, it } from 'vitest';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { SnapshotSlots } from '../host-broker/src/lifecycle/snapshot-slots.ts';
import type { SlotRef } from '../host-broker/src/backends/backend.ts';

/** A slot writer as QemuSandbox.suspend is one: complete files in `dir`, then its SlotRef. */
function writer(label: string, syncMarker?: string): (dir: string) => Promise<SlotRef> {
  return async (dir) => {
    mkdirSync(dir, { recursive: true });
    writeFileSync(join(dir, 'state.bin'), label);
    writeFileSync(join(dir, 'manifest.json'), '[]');
    return { dir, state: join(dir, 'state.bin'), manifest: join(dir, 'manifest.json'), pristineKey: 'p1', ...(syncMarker ? { syncMarker } : {}) };
  };
}

describe('snapshot slots', () => {
  const dirs: string[] = [];
  afterEach(() => {
    for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true });
  });
  const stateDir = () => {
    const d = mkdtempSync(join(tmpdir(), 'hutch-slots-'));
    dirs.push(d);
    return d;
  };

  it('each slot keeps the sync marker of its own last pull; the fallback slot keeps its own', async () => {
    const slots = new SnapshotSlots(stateDir());
    await slots.write(writer('one', 'aaaa1111'));
    expect(slots.current()?.syncMarker).toBe('aaaa1111');
    expect(slots.previous()).toBeUndefined();
    await slots.write(writer('two', 'bbbb2222'));
    expect(slots.current()?.syncMarker).toBe('bbbb2222');
    expect(readFileSync(slots.current()?.state as string, 'utf8')).toBe('two');
    expect(slots.previous()?.syncMarker).toBe('aaaa1111');
    // A slot written without one (an older broker) restores without: the wake push then scans.
    await slots.write(writer('three'));
    expect(slots.current()?.syncMarker).toBeUndefined();
  });

  it('a failed write leaves the current slot and its marker as they were', async () => {
    const slots = new SnapshotSlots(stateDir());
    await slots.write(writer('one', 'aaaa1111'));
    await expect(slots.write(async () => { throw new Error('disk full'); })).rejects.toThrow('disk full');
    expect(slots.current()?.syncMarker).toBe('aaaa1111');
    expect(readFileSync(slots.current()?.state as string, 'utf8')).toBe('one');
  });

  it('a slot.json whose marker is not a string gives no marker (the wake scans)', async () => {
    const dir = stateDir();
    const slots = new SnapshotSlots(dir);
    const ref = await slots.write(writer('one', 'aaaa1111'));
    writeFileSync(join(ref.dir, 'slot.json'), JSON.stringify({ pristineKey: 'p1', syncMarker: { evil: true } }));
    expect(new SnapshotSlots(dir).current()).toMatchObject({ pristineKey: 'p1' });
    expect(new SnapshotSlots(dir).current()?.syncMarker).toBeUndefined();
  });
});

describe("a slot's manifest file", () => {
  it('round-trips a large manifest line by line (odd names included), and still reads the one-array JSON of older slots', async () => {
    const { readManifest, writeManifest } = await import('../host-broker/src/sync/manifest.ts');
    const dir = mkdtempSync(join(tmpdir(), 'hutch-manifest-'));
    try {
      const m = new Map<string, { kind: 'file' | 'dir' | 'symlink'; size: number; mtimeMs: number; mode: number; target?: string }>();
      for (let i = 0; i < 30_000; i++) m.set(`d${i % 50}/f-${i}.ts`, { kind: 'file', size: i, mtimeMs: 1764680000000.5 + i, mode: 0o644 });
      m.set('name with\nnewline', { kind: 'file', size: 1, mtimeMs: 1, mode: 0o600 });
      m.set('lone \udc80 surrogate', { kind: 'symlink', size: 0, mtimeMs: 0, mode: 0, target: '../x\n' });
      m.set('日本/dir', { kind: 'dir', size: 0, mtimeMs: 0, mode: 0o755 });
      const path = join(dir, 'manifest.json');
      await writeManifest(path, m);
      expect(readFileSync(path, 'utf8').split('\n').length).toBe(m.size + 1);
      expect([...(await readManifest(path))]).toEqual([...m]);
      writeFileSync(path, JSON.stringify([...m.entries()]));
      expect([...(await readManifest(path))]).toEqual([...m]);
      await writeManifest(path, new Map());
      expect((await readManifest(path)).size).toBe(0);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
