/**
 * Compiles the fast path's syscall policy (seccomp-profile.ts) into a classic-BPF seccomp
 * program for `bwrap --seccomp FD`. There is no npm library for this (libseccomp needs a
 * native addon), and the program is small: an architecture check, an x32 check, then a
 * binary search over syscall-number ranges, so a syscall costs ~10 instructions instead of
 * a scan of 300 (the kernel's per-syscall action cache, 5.11+, then skips most of them).
 *
 *   ld arch;  arch != x86_64            -> KILL_PROCESS (i386 int 0x80 numbers mean other calls)
 *   ld nr;    nr & 0x40000000 (x32 ABI) -> ERRNO(EPERM)
 *   binary search on nr: allowed -> ALLOW; clone3, openat2 -> ERRNO(ENOSYS); clone,
 *   personality, socket, and the mode of chmod/open/mknod calls -> argument checks;
 *   everything else -> ERRNO(EPERM)
 *
 * Built once per process and cached: the policy is constant.
 */
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { decode, evaluate, Program } from './bpf.ts';
import { ALLOWED_SYSCALLS, ARG_RULES, ENOSYS_SYSCALLS, ERRNO_ENOSYS, ERRNO_EPERM, type ArgRule } from './seccomp-profile.ts';
import { SYSCALLS_X86_64 } from './syscalls-x86_64.ts';

export const AUDIT_ARCH_X86_64 = 0xc000003e;
export const AUDIT_ARCH_I386 = 0x40000003;
export const X32_SYSCALL_BIT = 0x40000000;

export const SECCOMP_RET_KILL_PROCESS = 0x80000000;
export const SECCOMP_RET_ERRNO = 0x00050000;
export const SECCOMP_RET_ALLOW = 0x7fff0000;
export const retErrno = (errno: number): number => (SECCOMP_RET_ERRNO | (errno & 0xffff)) >>> 0;

// Offsets in struct seccomp_data.
export const OFF_NR = 0;
export const OFF_ARCH = 4;
export const argLow = (i: number): number => 16 + 8 * i; // little-endian: low word first

type Action = { kind: 'ret'; k: number } | { kind: 'arg'; rule: ArgRule };
interface Segment {
  /** First syscall number of the range; it runs up to the next segment's start. */
  start: number;
  action: Action;
}

export interface SeccompFilter {
  /** struct sock_filter[] to hand to bwrap on a descriptor. */
  bpf: Buffer;
  instructions: number;
  allowed: readonly string[];
  argFiltered: readonly string[];
  enosys: readonly string[];
}

export function syscallNumber(name: string): number {
  const nr = SYSCALLS_X86_64[name];
  if (nr === undefined) throw new HutchError('internal', `unknown x86_64 syscall ${name}`, { syscall: name });
  return nr;
}

export interface BuildOptions {
  /**
   * errno for refused syscalls (default EPERM). Tests build the same policy with a marker
   * errno to prove, in the kernel, that a refusal comes from this filter and not from a
   * missing capability (which also says EPERM).
   */
  denyErrno?: number;
}

export function buildSeccompFilter(opts: BuildOptions = {}): SeccompFilter {
  const deny = retErrno(opts.denyErrno ?? ERRNO_EPERM);
  const actions = new Map<number, Action>();
  const set = (name: string, action: Action) => {
    const nr = syscallNumber(name);
    if (actions.has(nr)) throw new HutchError('internal', `syscall ${name} has two rules`, { syscall: name });
    actions.set(nr, action);
  };
  for (const name of ALLOWED_SYSCALLS) set(name, { kind: 'ret', k: SECCOMP_RET_ALLOW });
  for (const name of ENOSYS_SYSCALLS) set(name, { kind: 'ret', k: retErrno(ERRNO_ENOSYS) });
  for (const rule of ARG_RULES) set(rule.syscall, { kind: 'arg', rule });

  const p = new Program();
  p.loadAbs(OFF_ARCH).jump('eq', AUDIT_ARCH_X86_64, 1, 0).ret(SECCOMP_RET_KILL_PROCESS);
  p.loadAbs(OFF_NR).jump('set', X32_SYSCALL_BIT, 0, 1).ret(deny);
  emitSearch(p, segments(actions, deny), deny);
  return {
    bpf: p.assemble(),
    instructions: p.length,
    allowed: [...ALLOWED_SYSCALLS].sort(),
    argFiltered: ARG_RULES.map((r) => r.syscall),
    enosys: [...ENOSYS_SYSCALLS],
  };
}

let cached: SeccompFilter | undefined;

/** The compiled filter, built on first use and kept for the life of the process. */
export function seccompFilter(): SeccompFilter {
  cached ??= buildSeccompFilter();
  return cached;
}

/** What the filter answers for one syscall (by name or number) with given arguments. */
export function verdict(filter: SeccompFilter, syscall: string | number, args: readonly number[] = [], arch = AUDIT_ARCH_X86_64): number {
  const nr = typeof syscall === 'number' ? syscall : syscallNumber(syscall);
  return evaluate(decode(filter.bpf), { nr, arch, args });
}

/** Contiguous ranges of equal action over [0, 2^32), the default (EPERM) filling the gaps. */
function segments(actions: Map<number, Action>, denyK: number): Segment[] {
  const deny: Action = { kind: 'ret', k: denyK };
  const out: Segment[] = [];
  const push = (start: number, action: Action) => {
    const prev = out[out.length - 1];
    if (prev && prev.action.kind === 'ret' && action.kind === 'ret' && prev.action.k === action.k) return;
    out.push({ start, action });
  };
  push(0, deny);
  for (const nr of [...actions.keys()].sort((a, b) => a - b)) {
    push(nr, actions.get(nr) as Action);
    if (!actions.has(nr + 1)) push(nr + 1, deny);
  }
  return out;
}

/** Binary search over segments; A holds the syscall number on entry. */
function emitSearch(p: Program, segs: Segment[], deny: number): void {
  if (segs.length === 1) {
    emitAction(p, (segs[0] as Segment).action, deny);
    return;
  }
  const mid = segs.length >> 1;
  const right = p.newLabel('ge');
  p.jump('ge', (segs[mid] as Segment).start, 0, 1).ja(right);
  emitSearch(p, segs.slice(0, mid), deny);
  p.label(right);
  emitSearch(p, segs.slice(mid), deny);
}

function emitAction(p: Program, action: Action, deny: number): void {
  if (action.kind === 'ret') {
    p.ret(action.k);
    return;
  }
  const { rule } = action;
  const allow = SECCOMP_RET_ALLOW;
  if (rule.when) {
    // Condition not met: allowed; met: fall into the check below.
    p.loadAbs(argLow(rule.when.arg)).jump('set', rule.when.mask, 1, 0).ret(allow);
  }
  p.loadAbs(argLow(rule.arg));
  if (rule.denyMask !== undefined) {
    p.jump('set', rule.denyMask, 0, 1).ret(deny).ret(allow);
  } else if (rule.allowValues !== undefined) {
    const vs = rule.allowValues;
    vs.forEach((v, i) => p.jump('eq', v, vs.length - i, 0));
    p.ret(deny).ret(allow);
  } else if (rule.denyValues !== undefined) {
    const vs = rule.denyValues;
    vs.forEach((v, i) => p.jump('eq', v, vs.length - i, 0));
    p.ret(allow).ret(deny);
  } else {
    throw new HutchError('internal', `argument rule for ${rule.syscall} has no condition`);
  }
}
