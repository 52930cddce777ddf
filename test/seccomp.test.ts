import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { execFileSync } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync, chmodSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { noopLogger } from '../guest-agent/src/log.ts';
import { runProcess } from '../guest-agent/src/process/run-process.ts';
import { decode, evaluate, Program } from '../host-broker/src/fastpath/bpf.ts';
import { bwrapArgv, probeHostLayout } from '../host-broker/src/fastpath/bwrap-argv.ts';
import { FastPath } from '../host-broker/src/fastpath/index.ts';
import { DEFAULT_HEADER, parseUnistdHeader } from '../host-broker/src/fastpath/gen-syscall-table.ts';
import { createSandboxEtc, type SandboxEtc } from '../host-broker/src/fastpath/sandbox-etc.ts';
import {
  AUDIT_ARCH_I386,
  buildSeccompFilter,
  retErrno,
  SECCOMP_RET_ALLOW,
  SECCOMP_RET_KILL_PROCESS,
  seccompFilter,
  verdict,
} from '../host-broker/src/fastpath/seccomp-filter.ts';
import { ALLOWED_SYSCALLS, ARG_RULES, CLONE_NAMESPACE_FLAGS, ENOSYS_SYSCALLS } from '../host-broker/src/fastpath/seccomp-profile.ts';
import { SYSCALLS_X86_64 } from '../host-broker/src/fastpath/syscalls-x86_64.ts';

const EPERM = retErrno(1);
const ENOSYS = retErrno(38);
/** Never a real answer of these syscalls: proves a refusal came from the filter. */
const MARKER_ERRNO = 133; // EHWPOISON

/**
 * The filter's decisions, evaluated on the BPF program itself (an interpreter of the
 * instructions the assembler emits). The kernel tests below run the same program for real.
 */
describe('seccomp filter (program)', () => {
  const f = seccompFilter();

  it('is built once and cached', () => {
    expect(seccompFilter()).toBe(f);
    expect(f.bpf.length).toBe(f.instructions * 8);
    expect(f.instructions).toBeLessThan(4096);
  });

  it('uses syscall numbers from the kernel header (when the host has it)', () => {
    if (!existsSync(DEFAULT_HEADER)) {
      console.warn(`skipping header comparison: ${DEFAULT_HEADER} missing (install linux-libc-dev)`);
      return;
    }
    const fromHeader = Object.fromEntries(parseUnistdHeader(readFileSync(DEFAULT_HEADER, 'utf8')));
    for (const [name, nr] of Object.entries(SYSCALLS_X86_64)) expect(fromHeader[name], name).toBe(nr);
    expect(SYSCALLS_X86_64['clone3']).toBe(435);
    expect(SYSCALLS_X86_64['read']).toBe(0);
  });

  it('allows every syscall of the allowlist and nothing the profile leaves out', () => {
    for (const name of ALLOWED_SYSCALLS) expect(verdict(f, name), name).toBe(SECCOMP_RET_ALLOW);
    const allowed = new Set(ALLOWED_SYSCALLS);
    const special = new Set([...ARG_RULES.map((r) => r.syscall), ...ENOSYS_SYSCALLS]);
    for (const name of Object.keys(SYSCALLS_X86_64)) {
      if (!allowed.has(name) && !special.has(name)) expect(verdict(f, name), name).toBe(EPERM);
    }
  });

  it('refuses namespace, mount, tracing, key, bpf and kernel-loading syscalls with EPERM', () => {
    for (const name of ['unshare', 'setns', 'mount', 'umount2', 'pivot_root', 'chroot', 'ptrace', 'process_vm_readv', 'process_vm_writev', 'keyctl', 'add_key', 'request_key', 'bpf', 'perf_event_open', 'kexec_load', 'kexec_file_load', 'open_by_handle_at', 'init_module', 'finit_module', 'userfaultfd', 'io_uring_setup', 'io_uring_enter', 'reboot', 'swapon', 'fsopen', 'move_mount', 'open_tree']) {
      expect(verdict(f, name), name).toBe(EPERM);
    }
  });

  it('answers clone3 with ENOSYS so libc falls back to clone', () => {
    expect(verdict(f, 'clone3')).toBe(ENOSYS);
  });

  it('allows clone without namespace flags and refuses each CLONE_NEW* flag', () => {
    const SIGCHLD = 17;
    const threadFlags = 0x3d0f00; // what glibc's pthread_create passes
    expect(verdict(f, 'clone', [SIGCHLD])).toBe(SECCOMP_RET_ALLOW);
    expect(verdict(f, 'clone', [threadFlags])).toBe(SECCOMP_RET_ALLOW);
    for (let bit = 0; bit < 32; bit++) {
      const flag = 2 ** bit;
      if ((CLONE_NAMESPACE_FLAGS & flag) === 0) continue;
      expect(verdict(f, 'clone', [flag | SIGCHLD]), `flag 0x${flag.toString(16)}`).toBe(EPERM);
    }
    expect(verdict(f, 'clone', [0x10000000 | SIGCHLD])).toBe(EPERM); // CLONE_NEWUSER
  });

  it('filters socket domains and personality values like Docker', () => {
    expect(verdict(f, 'socket', [2])).toBe(SECCOMP_RET_ALLOW); // AF_INET
    expect(verdict(f, 'socket', [1])).toBe(SECCOMP_RET_ALLOW); // AF_UNIX
    expect(verdict(f, 'socket', [40])).toBe(EPERM); // AF_VSOCK
    expect(verdict(f, 'personality', [0xffffffff])).toBe(SECCOMP_RET_ALLOW);
    expect(verdict(f, 'personality', [0])).toBe(SECCOMP_RET_ALLOW);
    expect(verdict(f, 'personality', [0x0400000])).toBe(EPERM); // READ_IMPLIES_EXEC
  });

  it('refuses set-user-ID and set-group-ID modes (the sandbox user is root on the host)', () => {
    const O_CREAT = 0o100;
    const O_TMPFILE = 0o20200000;
    const AT_FDCWD = -100;
    expect(verdict(f, 'chmod', [0, 0o755])).toBe(SECCOMP_RET_ALLOW);
    expect(verdict(f, 'chmod', [0, 0o4755])).toBe(EPERM);
    expect(verdict(f, 'fchmod', [3, 0o2755])).toBe(EPERM);
    expect(verdict(f, 'fchmodat', [AT_FDCWD, 0, 0o6755])).toBe(EPERM);
    expect(verdict(f, 'fchmodat', [AT_FDCWD, 0, 0o644])).toBe(SECCOMP_RET_ALLOW);
    expect(verdict(f, 'creat', [0, 0o4755])).toBe(EPERM);
    expect(verdict(f, 'mknodat', [AT_FDCWD, 0, 0o100000 | 0o4755, 0])).toBe(EPERM);
    // The mode of a non-creating open is ignored by the kernel, so it is ignored here too.
    expect(verdict(f, 'openat', [AT_FDCWD, 0, 0, 0o4755])).toBe(SECCOMP_RET_ALLOW);
    expect(verdict(f, 'openat', [AT_FDCWD, 0, O_CREAT | 1, 0o644])).toBe(SECCOMP_RET_ALLOW);
    expect(verdict(f, 'openat', [AT_FDCWD, 0, O_CREAT | 1, 0o4755])).toBe(EPERM);
    expect(verdict(f, 'openat', [AT_FDCWD, 0, O_TMPFILE | 1, 0o2755])).toBe(EPERM);
    expect(verdict(f, 'open', [0, O_CREAT | 1, 0o4755])).toBe(EPERM);
    expect(verdict(f, 'open', [0, 0, 0o4755])).toBe(SECCOMP_RET_ALLOW);
    expect(verdict(f, 'openat2')).toBe(ENOSYS);
  });

  it('kills other architectures and refuses x32 and unknown syscall numbers', () => {
    expect(verdict(f, 20, [], AUDIT_ARCH_I386)).toBe(SECCOMP_RET_KILL_PROCESS);
    expect(verdict(f, 0x40000000 | 39)).toBe(EPERM); // x32 getpid
    expect(verdict(f, 0x40000000 | 0)).toBe(EPERM); // x32 read
    expect(verdict(f, 451)).toBe(EPERM);
    expect(verdict(f, 0xffffffff)).toBe(EPERM);
  });

  it('can use another errno for refusals (used below to prove refusals come from the filter)', () => {
    const marked = buildSeccompFilter({ denyErrno: MARKER_ERRNO });
    expect(verdict(marked, 'keyctl')).toBe(retErrno(MARKER_ERRNO));
    expect(verdict(marked, 'read')).toBe(SECCOMP_RET_ALLOW);
    expect(verdict(marked, 'clone3')).toBe(ENOSYS);
  });
});

describe('bpf assembler', () => {
  it('resolves forward labels and encodes struct sock_filter', () => {
    const p = new Program();
    const l = p.newLabel();
    p.loadAbs(0).jump('eq', 7, 0, 1).ja(l).ret(1).label(l).ret(2);
    const insns = decode(p.assemble());
    expect(insns).toHaveLength(5);
    expect(insns[2]).toMatchObject({ code: 0x05, k: 1 });
    expect(evaluate(insns, { nr: 7, arch: 0 })).toBe(2);
    expect(evaluate(insns, { nr: 8, arch: 0 })).toBe(1);
  });

  it('rejects programs that could misbehave in the kernel', () => {
    expect(() => new Program().loadAbs(0).assemble()).toThrow(/end with ret/);
    expect(() => new Program().jump('eq', 1, 300, 0)).toThrow(/out of range/);
    expect(() => new Program().ja('nowhere').ret(0).assemble()).toThrow(/never placed/);
    expect(() => new Program().loadAbs(0).jump('eq', 1, 5, 0).ret(0).assemble()).toThrow(/past end/);
  });
});

// A small C program that makes real syscalls and prints "name rc errno" per line.
const PROBE_C = String.raw`
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include <linux/sched.h>

static void report(const char *name, long rc) { printf("%s %d %d\n", name, rc < 0 ? -1 : rc > 0 ? 1 : 0, rc < 0 ? errno : 0); }
static void *thread_fn(void *arg) { return arg; }
static long raw_clone(unsigned long flags) {
  long rc = syscall(SYS_clone, flags, 0, 0, 0, 0);
  if (rc == 0) _exit(0);
  if (rc > 0) waitpid((pid_t)rc, 0, 0);
  return rc;
}
/* The i386 ABI (int 0x80) from a 64-bit process: prints the signal that ended the child. */
static int i386_getpid(void) {
  pid_t p = fork();
  if (p == 0) { long r = 20; __asm__ volatile("int $0x80" : "+a"(r) : : "r8", "r9", "r10", "r11", "memory"); _exit(r > 0 ? 0 : 3); }
  int st = 0; waitpid(p, &st, 0);
  return WIFSIGNALED(st) ? WTERMSIG(st) : 0;
}
int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IONBF, 0);
  if (argc > 1) { printf("i386_signal %d\n", i386_getpid()); return 0; }
  report("getpid", syscall(SYS_getpid));
  int fd = open("/etc/passwd", O_RDONLY); report("open", fd); if (fd >= 0) close(fd);
  pid_t p = fork(); if (p == 0) _exit(7); int st = 0; waitpid(p, &st, 0);
  report("fork", p > 0 && WIFEXITED(st) && WEXITSTATUS(st) == 7 ? 1 : -1);
  pthread_t t; int pe = pthread_create(&t, NULL, thread_fn, NULL); if (!pe) pthread_join(t, NULL); errno = pe; report("pthread", pe ? -1 : 1);
  struct clone_args ca; memset(&ca, 0, sizeof ca); ca.exit_signal = SIGCHLD;
  long c3 = syscall(SYS_clone3, &ca, sizeof ca); if (c3 == 0) _exit(0); if (c3 > 0) waitpid((pid_t)c3, 0, 0); report("clone3", c3);
  report("clone_plain", raw_clone(SIGCHLD));
  report("clone_newuser", raw_clone(CLONE_NEWUSER | SIGCHLD));
  report("clone_newns", raw_clone(CLONE_NEWNS | SIGCHLD));
  report("clone_newnet", raw_clone(CLONE_NEWNET | SIGCHLD));
  report("clone_newpid", raw_clone(CLONE_NEWPID | SIGCHLD));
  report("unshare_user", syscall(SYS_unshare, CLONE_NEWUSER));
  report("unshare_ns", syscall(SYS_unshare, CLONE_NEWNS));
  report("setns", syscall(SYS_setns, 0, 0));
  report("mount", syscall(SYS_mount, "none", "/tmp", "tmpfs", 0, 0));
  report("umount2", syscall(SYS_umount2, "/work", 0));
  report("pivot_root", syscall(SYS_pivot_root, "/tmp", "/tmp"));
  report("chroot", syscall(SYS_chroot, "/tmp"));
  report("ptrace", syscall(SYS_ptrace, 0 /* PTRACE_TRACEME */, 0, 0, 0));
  report("process_vm_readv", syscall(SYS_process_vm_readv, getpid(), 0, 0, 0, 0, 0));
  report("keyctl", syscall(SYS_keyctl, 0 /* KEYCTL_GET_KEYRING_ID */, -3 /* session */, 0));
  report("add_key", syscall(SYS_add_key, "user", "hutch", "x", 1, -3));
  report("request_key", syscall(SYS_request_key, "user", "hutch", 0, 0));
  report("bpf", syscall(SYS_bpf, 0, 0, 0));
  report("perf_event_open", syscall(SYS_perf_event_open, 0, 0, -1, -1, 0));
  report("kexec_load", syscall(SYS_kexec_load, 0, 0, 0, 0));
  report("open_by_handle_at", syscall(SYS_open_by_handle_at, -1, 0, 0));
  report("init_module", syscall(SYS_init_module, 0, 0, ""));
  report("userfaultfd", syscall(SYS_userfaultfd, 0));
  report("io_uring_setup", syscall(SYS_io_uring_setup, 1, 0));
  report("socket_inet", socket(AF_INET, SOCK_STREAM, 0));
  report("socket_unix", socket(AF_UNIX, SOCK_STREAM, 0));
  report("socket_vsock", socket(40, SOCK_STREAM, 0));
  report("personality_query", syscall(SYS_personality, 0xffffffffUL) >= 0 ? 1 : -1);
  report("personality_rie", syscall(SYS_personality, 0x0400000UL));
  report("open_creat_plain", syscall(SYS_open, "probe-plain", O_CREAT | O_WRONLY, 0644));
  report("chmod_plain", syscall(SYS_chmod, "probe-plain", 0755));
  report("open_nocreat_modebits", syscall(SYS_open, "probe-plain", O_RDONLY, 04755));
  report("chmod_setuid", syscall(SYS_chmod, "probe-plain", 04755));
  report("fchmodat_setgid", syscall(SYS_fchmodat, AT_FDCWD, "probe-plain", 02755, 0));
  report("open_creat_setuid", syscall(SYS_open, "probe-suid", O_CREAT | O_WRONLY, 04755));
  report("openat_tmpfile_setuid", syscall(SYS_openat, AT_FDCWD, ".", O_TMPFILE | O_WRONLY, 04755));
  report("creat_setuid", syscall(SYS_creat, "probe-suid2", 04755));
  report("mknod_setuid", syscall(SYS_mknodat, AT_FDCWD, "probe-suid3", S_IFREG | 04755, 0));
  report("openat2", syscall(SYS_openat2, AT_FDCWD, "probe-plain", 0, 0));
  report("x32_getpid", syscall(0x40000000 | 39));
  report("x32_read", syscall(0x40000000 | 0, 0, 0, 0));
  return 0;
}
`;

const ALLOWED_CALLS = ['getpid', 'open', 'fork', 'pthread', 'clone_plain', 'socket_inet', 'socket_unix', 'personality_query', 'open_creat_plain', 'chmod_plain', 'open_nocreat_modebits'];
const REFUSED_CALLS = [
  'clone_newuser', 'clone_newns', 'clone_newnet', 'clone_newpid', 'unshare_user', 'unshare_ns', 'setns', 'mount', 'umount2',
  'pivot_root', 'chroot', 'ptrace', 'process_vm_readv', 'keyctl', 'add_key', 'request_key', 'bpf', 'perf_event_open',
  'kexec_load', 'open_by_handle_at', 'init_module', 'userfaultfd', 'io_uring_setup', 'socket_vsock', 'personality_rie',
  'x32_getpid', 'x32_read', 'chmod_setuid', 'fchmodat_setgid', 'open_creat_setuid', 'openat_tmpfile_setuid', 'creat_setuid',
  'mknod_setuid',
];

type Outcome = { ok: boolean; errno: number };

function parseProbe(text: string): Map<string, Outcome> {
  const out = new Map<string, Outcome>();
  for (const line of text.trim().split('\n')) {
    const [name, rc, errno] = line.split(' ');
    if (name) out.set(name, { ok: Number(rc) >= 0, errno: Number(errno) });
  }
  return out;
}

function hasGcc(): boolean {
  try {
    execFileSync('gcc', ['--version'], { stdio: 'ignore' });
    return true;
  } catch {
    return false;
  }
}

/** Real syscalls under the real filter, in the real sandbox. */
describe('seccomp filter (in the kernel, inside bwrap)', () => {
  let dir: string;
  let fp: FastPath;
  let etc: SandboxEtc;

  beforeAll(async () => {
    if (!hasGcc()) throw new Error('these tests compile a syscall probe: install gcc and libc6-dev (apt-get install gcc libc6-dev)');
    dir = mkdtempSync(join(tmpdir(), 'hutch-seccomp-test-'));
    chmodSync(dir, 0o755);
    writeFileSync(join(dir, 'probe.c'), PROBE_C);
    execFileSync('gcc', ['-O1', '-pthread', '-o', join(dir, 'probe'), join(dir, 'probe.c')]);
    fp = await FastPath.create({ log: noopLogger });
    etc = createSandboxEtc({ uid: 1000, gid: 1000, user: 'user', home: '/tmp' });
  });
  afterAll(async () => {
    await fp?.close();
    etc?.remove();
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  async function probeInFastPath(args = ''): Promise<Map<string, Outcome>> {
    let out = '';
    let err = '';
    const r = await fp.run({ command: `./probe ${args}`, workspace: dir, onStdout: (c) => void (out += c), onStderr: (c) => void (err += c) });
    expect(r.exitCode, err).toBe(0);
    return parseProbe(out);
  }

  /** The same bwrap flags with another filter on fd 3 (the fast path's own filter is fixed). */
  async function probeWithFilter(bpf: Buffer): Promise<Map<string, Outcome>> {
    let out = '';
    let err = '';
    const argv = bwrapArgv({
      bwrap: '/usr/bin/bwrap',
      workspace: dir,
      cwd: '/work',
      env: { PATH: '/usr/bin:/bin' },
      etcDir: etc.dir,
      emptyDir: etc.emptyDir,
      identity: { uid: 1000, gid: 1000, user: 'user', home: '/tmp' },
      layout: probeHostLayout(),
      tmpBytes: 16 << 20,
      command: './probe',
    });
    const r = await runProcess({ argv, cwd: '/', env: { PATH: '/usr/bin:/bin' }, extraInputs: [bpf], killGroupOnExit: true, timeoutMs: 30_000, onStdout: (c) => void (out += c), onStderr: (c) => void (err += c) }).result;
    expect(r.exitCode, err).toBe(0);
    return parseProbe(out);
  }

  it('the filter is active in the sandbox', async () => {
    let out = '';
    // The fast path has no procfs (bwrap-argv.ts, PROC_EXPOSED): ask the kernel directly, prctl(PR_GET_SECCOMP),
    // prctl(PR_GET_NO_NEW_PRIVS) and capget, printed as /proc/self/status would.
    const perl = 'print "Seccomp:\\t", syscall(157, 21, 0, 0, 0, 0), "\\nNoNewPrivs:\\t", syscall(157, 39, 0, 0, 0, 0), "\\n"; my $h = pack("Li", 0x20080522, 0); my $d = "\\0" x 24; syscall(125, $h, $d) == 0 or die "capget: $!"; my @v = unpack("L6", $d); printf "CapEff:\\t%08x%08x\\n", $v[3], $v[0];';
    await fp.run({ command: `perl -e '${perl}'`, workspace: dir, onStdout: (c) => void (out += c) });
    expect(out).toMatch(/Seccomp:\s+2/);
    expect(out).toMatch(/NoNewPrivs:\s+1/);
    expect(out).toMatch(/CapEff:\s+0+\n/);
  });

  it('allowed syscalls work; fork and threads work although clone3 says ENOSYS', async () => {
    const res = await probeInFastPath();
    for (const name of ALLOWED_CALLS) expect(res.get(name), name).toEqual({ ok: true, errno: 0 });
    expect(res.get('clone3')).toEqual({ ok: false, errno: 38 });
    expect(res.get('openat2')).toEqual({ ok: false, errno: 38 });
  });

  it('unshare, mount, ptrace, keyctl, bpf, perf_event_open, add_key, kexec_load, open_by_handle_at, clone(CLONE_NEWUSER), x32 calls and set-ID modes fail with EPERM', async () => {
    const res = await probeInFastPath();
    for (const name of REFUSED_CALLS) expect(res.get(name), name).toEqual({ ok: false, errno: 1 });
  });

  it('each refusal comes from the filter, not from a missing capability (same policy, marker errno)', async () => {
    const res = await probeWithFilter(buildSeccompFilter({ denyErrno: MARKER_ERRNO }).bpf);
    for (const name of REFUSED_CALLS) expect(res.get(name), name).toEqual({ ok: false, errno: MARKER_ERRNO });
    for (const name of ALLOWED_CALLS) expect(res.get(name), name).toEqual({ ok: true, errno: 0 });
  });

  it('a syscall of another architecture (i386 int 0x80) kills the process with SIGSYS', async (ctx) => {
    // Outside any filter first: some kernels (this host's PVM guest kernel among them) do not
    // offer the i386 entry at all and answer int 0x80 with SIGSEGV; then there is nothing to test.
    const bare = execFileSync(join(dir, 'probe'), ['i386'], { encoding: 'utf8' });
    if (!/^i386_signal 0$/m.test(bare)) {
      ctx.skip(`this kernel has no usable i386 syscall entry (unfiltered int 0x80 gave "${bare.trim()}"); the BPF test above covers the arch check`);
    }
    let out = '';
    await fp.run({ command: './probe i386', workspace: dir, onStdout: (c) => void (out += c) });
    expect(out.trim()).toBe('i386_signal 31'); // SIGSYS
  });
});
