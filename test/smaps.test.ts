import { describe, expect, it } from 'vitest';
import { readFileSync } from 'node:fs';
import { processMemory, qemuMemory, splitTcg } from '../host-broker/src/vm/smaps.ts';

/**
 * The TCG buffer split of a process's memory (host-broker/src/vm/smaps.ts), on real smaps
 * text: this process's own, and QEMU-shaped lines cut from a restored VM's smaps.
 */
describe('smaps', () => {
  it("adds up a real process's mappings to what smaps_rollup says", async () => {
    const split = await qemuMemory(process.pid);
    const rollup = await processMemory(process.pid);
    // Both are read a moment apart from a live process: close, not equal.
    expect(Math.abs(split.total.rssKiB - rollup.rssKiB)).toBeLessThan(rollup.rssKiB * 0.05);
    expect(split.total.privateKiB).toBeGreaterThan(0);
    expect(split.excludingTcg.rssKiB).toBe(split.total.rssKiB - split.tcg.rssKiB);
  });

  it('counts an anonymous rwx mapping as the translation buffer, and nothing else', () => {
    const text = [
      // QEMU's binary text: executable but file-backed.
      '555fa509c000-555fa5633000 r-xp 00407000 fe:00 2170896                    /usr/bin/qemu-system-x86_64',
      'Size:               5724 kB',
      'Rss:                5480 kB',
      'Pss:                2750 kB',
      'Private_Clean:        20 kB',
      'Private_Dirty:         0 kB',
      'Anonymous:             0 kB',
      'Swap:                  0 kB',
      // The heap: anonymous, not executable.
      '555fba37b000-555fbab69000 rw-p 00000000 00:00 0                          [heap]',
      'Size:               8120 kB',
      'Rss:                5140 kB',
      'Pss:                5140 kB',
      'Private_Clean:         0 kB',
      'Private_Dirty:      5140 kB',
      'Anonymous:          5140 kB',
      'Swap:                  0 kB',
      // Guest RAM: the snapshot's memory file mapped copy-on-write.
      '7fabb7fff000-7fabd7fff000 rw-p 00000000 fe:00 16417280                   /root/.cache/hutch/snapshots/k/memory.img',
      'Size:             524288 kB',
      'Rss:               69524 kB',
      'Pss:               41884 kB',
      'Private_Clean:        88 kB',
      'Private_Dirty:     14156 kB',
      'Anonymous:         14156 kB',
      'Swap:                  0 kB',
      // The buffer (tb-size=64: one page short for the guard page after it).
      '7fabd8000000-7fabdbfff000 rwxp 00000000 00:00 0 ',
      'Size:              65532 kB',
      'Rss:               36864 kB',
      'Pss:               36864 kB',
      'Private_Clean:         0 kB',
      'Private_Dirty:     36864 kB',
      'Anonymous:         36864 kB',
      'Swap:                  0 kB',
      '7fabdbfff000-7fabdc000000 ---p 00000000 00:00 0 ',
      'Size:                  4 kB',
      'Rss:                   0 kB',
      '',
    ].join('\n');
    const m = splitTcg(text, '/root/.cache/hutch/snapshots/k/memory.img');
    expect(m.tcg).toEqual({ sizeKiB: 65532, rssKiB: 36864, pssKiB: 36864, privateKiB: 36864, swapKiB: 0, anonKiB: 36864 });
    expect(m.total.rssKiB).toBe(5480 + 5140 + 69524 + 36864);
    expect(m.excludingTcg.privateKiB).toBe(20 + 5140 + 88 + 14156);
    expect(m.excludingTcg.anonKiB).toBe(5140 + 14156);
    expect(m.guestRam.privateKiB).toBe(88 + 14156);
    expect(splitTcg(text).guestRam.rssKiB).toBe(0);
  });

  it('finds no buffer where there is none', () => {
    const self = splitTcg(readFileSync('/proc/self/smaps', 'utf8').replace(/ rwxp /g, ' r-xp '));
    expect(self.tcg.sizeKiB).toBe(0);
  });
});
