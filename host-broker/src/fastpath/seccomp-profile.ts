/**
 * The fast path's syscall policy, as data: Docker's default seccomp profile for x86_64
 * without capabilities, with the changes below. The filter compiler (seccomp-filter.ts)
 * turns it into BPF; the tests run real syscalls against the result.
 *
 * Source of the allowlist: moby/moby profiles/seccomp/default.json at commit
 * 00f3d189e420d485e42d15fe494f96d272284e0e, its unconditional SCMP_ACT_ALLOW rule plus the
 * rules that apply to amd64 without capabilities (arch_prctl, modify_ldt, the argument
 * filtered personality/socket/clone rules, clone3 -> ENOSYS). Names that exist only on
 * 32-bit ABIs (chown32, mmap2, socketcall, *_time64, ...) are not in the x86_64 table and
 * are left out here.
 *
 * Changes against that profile, each stricter:
 * - io_uring_setup/enter/register: refused. Its rings run file and socket operations the
 *   filter never sees; moby itself removed them later (moby/moby#46762, Docker 25).
 * - ptrace, process_vm_readv, process_vm_writev: refused. Docker allows them on kernels
 *   >= 4.8; read/edit tools have no use for them and the issue requires ptrace to fail.
 * - No set-user-ID or set-group-ID files: chmod/fchmod/fchmodat, creating opens
 *   (open/openat with O_CREAT or O_TMPFILE, creat) and mknod/mknodat are refused when the
 *   mode has S_ISUID or S_ISGID. bwrap started by a root broker maps the sandbox user to
 *   host uid 0, so the files it creates in the workspace belong to root on the host; without
 *   this a tenant could leave a set-user-ID-root program there. openat2, whose mode sits in
 *   a struct BPF cannot read, answers ENOSYS so callers fall back to openat.
 */

/** Allowed whatever their arguments. */
export const ALLOWED_SYSCALLS: readonly string[] = [
  'accept', 'accept4', 'access', 'adjtimex', 'alarm', 'arch_prctl', 'bind', 'brk', 'capget', 'capset',
  'chdir', 'chown', 'clock_adjtime', 'clock_getres', 'clock_gettime', 'clock_nanosleep',
  'close', 'close_range', 'connect', 'copy_file_range', 'dup', 'dup2', 'dup3',
  'epoll_create', 'epoll_create1', 'epoll_ctl', 'epoll_ctl_old', 'epoll_pwait', 'epoll_pwait2',
  'epoll_wait', 'epoll_wait_old', 'eventfd', 'eventfd2', 'execve', 'execveat', 'exit', 'exit_group',
  'faccessat', 'faccessat2', 'fadvise64', 'fallocate', 'fanotify_mark', 'fchdir', 'fchown', 'fchownat', 'fcntl', 'fdatasync', 'fgetxattr', 'flistxattr', 'flock', 'fork',
  'fremovexattr', 'fsetxattr', 'fstat', 'fstatfs', 'fsync', 'ftruncate', 'futex', 'futex_waitv',
  'futimesat', 'getcpu', 'getcwd', 'getdents', 'getdents64', 'getegid', 'geteuid', 'getgid',
  'getgroups', 'getitimer', 'getpeername', 'getpgid', 'getpgrp', 'getpid', 'getppid', 'getpriority',
  'getrandom', 'getresgid', 'getresuid', 'getrlimit', 'get_robust_list', 'getrusage', 'getsid',
  'getsockname', 'getsockopt', 'get_thread_area', 'gettid', 'gettimeofday', 'getuid', 'getxattr',
  'inotify_add_watch', 'inotify_init', 'inotify_init1', 'inotify_rm_watch', 'io_cancel', 'ioctl',
  'io_destroy', 'io_getevents', 'io_pgetevents', 'ioprio_get', 'ioprio_set', 'io_setup', 'io_submit',
  'kill', 'landlock_add_rule', 'landlock_create_ruleset', 'landlock_restrict_self', 'lchown',
  'lgetxattr', 'link', 'linkat', 'listen', 'listxattr', 'llistxattr', 'lremovexattr', 'lseek',
  'lsetxattr', 'lstat', 'madvise', 'membarrier', 'memfd_create', 'memfd_secret', 'mincore', 'mkdir',
  'mkdirat', 'mlock', 'mlock2', 'mlockall', 'mmap', 'modify_ldt', 'mprotect',
  'mq_getsetattr', 'mq_notify', 'mq_open', 'mq_timedreceive', 'mq_timedsend', 'mq_unlink', 'mremap',
  'msgctl', 'msgget', 'msgrcv', 'msgsnd', 'msync', 'munlock', 'munlockall', 'munmap',
  'name_to_handle_at', 'nanosleep', 'newfstatat', 'pause', 'pidfd_open',
  'pidfd_send_signal', 'pipe', 'pipe2', 'pkey_alloc', 'pkey_free', 'pkey_mprotect', 'poll', 'ppoll',
  'prctl', 'pread64', 'preadv', 'preadv2', 'prlimit64', 'process_mrelease', 'pselect6', 'pwrite64',
  'pwritev', 'pwritev2', 'read', 'readahead', 'readlink', 'readlinkat', 'readv', 'recvfrom',
  'recvmmsg', 'recvmsg', 'remap_file_pages', 'removexattr', 'rename', 'renameat', 'renameat2',
  'restart_syscall', 'rmdir', 'rseq', 'rt_sigaction', 'rt_sigpending', 'rt_sigprocmask',
  'rt_sigqueueinfo', 'rt_sigreturn', 'rt_sigsuspend', 'rt_sigtimedwait', 'rt_tgsigqueueinfo',
  'sched_getaffinity', 'sched_getattr', 'sched_getparam', 'sched_get_priority_max',
  'sched_get_priority_min', 'sched_getscheduler', 'sched_rr_get_interval', 'sched_setaffinity',
  'sched_setattr', 'sched_setparam', 'sched_setscheduler', 'sched_yield', 'seccomp', 'select',
  'semctl', 'semget', 'semop', 'semtimedop', 'sendfile', 'sendmmsg', 'sendmsg', 'sendto', 'setfsgid',
  'setfsuid', 'setgid', 'setgroups', 'setitimer', 'setpgid', 'setpriority', 'setregid', 'setresgid',
  'setresuid', 'setreuid', 'setrlimit', 'set_robust_list', 'setsid', 'setsockopt', 'set_thread_area',
  'set_tid_address', 'setuid', 'setxattr', 'shmat', 'shmctl', 'shmdt', 'shmget', 'shutdown',
  'sigaltstack', 'signalfd', 'signalfd4', 'socketpair', 'splice', 'stat', 'statfs', 'statx',
  'symlink', 'symlinkat', 'sync', 'sync_file_range', 'syncfs', 'sysinfo', 'tee', 'tgkill', 'time',
  'timer_create', 'timer_delete', 'timer_getoverrun', 'timer_gettime', 'timer_settime',
  'timerfd_create', 'timerfd_gettime', 'timerfd_settime', 'times', 'tkill', 'truncate', 'umask',
  'uname', 'unlink', 'unlinkat', 'utime', 'utimensat', 'utimes', 'vfork', 'vmsplice', 'wait4',
  'waitid', 'write', 'writev',
];

/** Syscalls whose verdict depends on one 32-bit argument (the kernel reads these as int). */
export interface ArgRule {
  syscall: string;
  /** Argument index (0-based); only its low 32 bits are compared. */
  arg: number;
  /** Check only when (args[when.arg] & when.mask) != 0 (open's mode matters only when it creates); otherwise allowed. */
  when?: { arg: number; mask: number };
  /** Allowed when (arg & mask) == 0 (clone's namespace flags). */
  denyMask?: number;
  /** Allowed when arg equals one of these (personality). */
  allowValues?: readonly number[];
  /** Allowed unless arg equals one of these (socket domains). */
  denyValues?: readonly number[];
}

/** CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET (moby's 2114060288). */
export const CLONE_NAMESPACE_FLAGS = 0x7e020000;
const AF_VSOCK = 40;
/** S_ISUID | S_ISGID. */
export const SETID_MODE_BITS = 0o6000;
/** O_CREAT | __O_TMPFILE: the open flags under which the mode argument is used. */
const O_CREATES = 0o100 | 0o20000000;

export const ARG_RULES: readonly ArgRule[] = [
  // clone(2) cannot carry CLONE_NEWTIME (0x80 is the exit-signal byte there), so these are all of them.
  { syscall: 'clone', arg: 0, denyMask: CLONE_NAMESPACE_FLAGS },
  // PER_LINUX, UNAME26, ADDR_NO_RANDOMIZE, both, and the 0xffffffff query.
  { syscall: 'personality', arg: 0, allowValues: [0x0, 0x8, 0x20000, 0x20008, 0xffffffff] },
  { syscall: 'socket', arg: 0, denyValues: [AF_VSOCK] },
  { syscall: 'chmod', arg: 1, denyMask: SETID_MODE_BITS },
  { syscall: 'fchmod', arg: 1, denyMask: SETID_MODE_BITS },
  { syscall: 'fchmodat', arg: 2, denyMask: SETID_MODE_BITS },
  { syscall: 'creat', arg: 1, denyMask: SETID_MODE_BITS },
  { syscall: 'open', arg: 2, denyMask: SETID_MODE_BITS, when: { arg: 1, mask: O_CREATES } },
  { syscall: 'openat', arg: 3, denyMask: SETID_MODE_BITS, when: { arg: 2, mask: O_CREATES } },
  { syscall: 'mknod', arg: 1, denyMask: SETID_MODE_BITS },
  { syscall: 'mknodat', arg: 2, denyMask: SETID_MODE_BITS },
];

/**
 * Answered ENOSYS rather than EPERM: glibc (2.34+) tries clone3 first and falls back to
 * clone only on ENOSYS. clone3's flags live in a struct that BPF cannot read, so it cannot
 * be filtered for namespace flags; refusing it entirely and filtering clone is the standard
 * answer. openat2 likewise (its mode is in a struct; see above).
 */
export const ENOSYS_SYSCALLS: readonly string[] = ['clone3', 'openat2'];

export const ERRNO_EPERM = 1;
export const ERRNO_ENOSYS = 38;
