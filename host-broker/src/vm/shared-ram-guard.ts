import { createHash } from 'node:crypto';
import { closeSync, existsSync, openSync, renameSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Program } from '../fastpath/bpf.ts';
import { AUDIT_ARCH_X86_64, OFF_ARCH, OFF_NR, SECCOMP_RET_ALLOW, argLow, retErrno, syscallNumber } from '../fastpath/seccomp-filter.ts';

/** linux/falloc.h */
const FALLOC_FL_PUNCH_HOLE = 0x02;
/** The descriptor bwrap reads the filter from in the child (qemu-jail.ts wrapperArgv). */
export const FILTER_FD = 3;

/**
 * Every restored VM maps the one pristine memory file privately (copy-on-write). When its
 * guest reports free pages (virtio-balloon free page reporting), QEMU 7.2 discards them by
 * punching a hole in that file, even though its mapping is private (fixed in QEMU 8.1):
 * every other VM restored from the file, and every later restore, would read zeros there.
 *
 * So restored QEMUs run under a seccomp filter that answers fallocate(PUNCH_HOLE) with
 * success without doing it. QEMU then drops its private copy of the page (madvise
 * DONTNEED), which returns the memory to the host; the guest's next touch of that free
 * page maps the file's pristine content again, which a free page may hold. Everything
 * else QEMU does is allowed: this is a guard for the shared file, not a sandbox.
 * (Swap-disk discards are swallowed the same way; the swap file stays sparse-ish.)
 */
let compiled: Buffer | undefined;

export function sharedRamGuardFilter(): Buffer {
  if (compiled) return compiled;
  const p = new Program();
  p.loadAbs(OFF_ARCH).jump('eq', AUDIT_ARCH_X86_64, 1, 0).ret(SECCOMP_RET_ALLOW);
  p.loadAbs(OFF_NR).jump('eq', syscallNumber('fallocate'), 1, 0).ret(SECCOMP_RET_ALLOW);
  p.loadAbs(argLow(1)).jump('set', FALLOC_FL_PUNCH_HOLE, 0, 1).ret(retErrno(0)).ret(SECCOMP_RET_ALLOW);
  compiled = p.assemble();
  return compiled;
}

/**
 * Opens the compiled filter for a child's fd 3 (the caller closes it after spawning). It is
 * written once per content to the temp dir: a file, not a pipe, so nothing of the broker's
 * stays attached to the VM's process.
 */
export function openGuardFilter(): number {
  const bpf = sharedRamGuardFilter();
  const path = join(tmpdir(), `hutch-shared-ram-guard-${createHash('sha256').update(bpf).digest('hex').slice(0, 16)}.bpf`);
  if (!existsSync(path)) {
    const tmp = `${path}.tmp-${process.pid}`;
    writeFileSync(tmp, bpf);
    renameSync(tmp, path);
  }
  return openSync(path, 'r');
}

export function closeFd(fd: number): void {
  try {
    closeSync(fd);
  } catch {
    // already closed
  }
}
