import { describe, expect, it } from 'vitest';
import { HutchError } from '../guest-agent/src/protocol/errors.ts';
import { DEFAULT_VM_UID_BASE, jailArgs, VmUidPool, wrapperArgv } from '../host-broker/src/vm/qemu-jail.ts';

describe('QEMU jail: user ids and sandbox flags', () => {
  it('hands each live VM its own id, and an id again only after its VM is gone', () => {
    const pool = new VmUidPool(DEFAULT_VM_UID_BASE, 3);
    const a = pool.acquire();
    const b = pool.acquire();
    const c = pool.acquire();
    expect(new Set([a, b, c]).size).toBe(3);
    expect([a, b, c].every((u) => u >= DEFAULT_VM_UID_BASE && u < DEFAULT_VM_UID_BASE + 3)).toBe(true);
    expect(() => pool.acquire()).toThrow(HutchError);
    pool.release(b);
    expect(pool.acquire()).toBe(b);
    expect(pool.inUse).toBe(3);
  });

  it('refuses a range that would reach root or past 2^31', () => {
    expect(() => new VmUidPool(0, 10)).toThrow(/within/);
    expect(() => new VmUidPool(2 ** 31 - 5, 10)).toThrow(/within/);
  });

  it('wraps a jailed QEMU in pid and network namespaces of its own (its parent-death signal goes with the uid change)', () => {
    expect(wrapperArgv(['qemu'], { jailed: true })).toEqual(['bwrap', '--dev-bind', '/', '/', '--die-with-parent', '--unshare-pid', '--unshare-net', '--', 'qemu']);
    expect(wrapperArgv(['qemu'], { jailed: false, filterFd: 3 })).toEqual(['bwrap', '--dev-bind', '/', '/', '--die-with-parent', '--seccomp', '3', '--', 'qemu']);
  });

  it('drops to the id and denies new processes, except for a build VM', () => {
    expect(jailArgs({ uid: 2_100_000_007, spawn: false })).toEqual(['-runas', '2100000007:2100000007', '-sandbox', 'on,obsolete=deny,resourcecontrol=deny,spawn=deny']);
    expect(jailArgs({ uid: 2_100_000_008, spawn: true })).toEqual(['-runas', '2100000008:2100000008', '-sandbox', 'on,obsolete=deny,resourcecontrol=deny,spawn=allow']);
  });
});
