/**
 * The bubblewrap command line of one fast-path run. Every flag is a security decision, so
 * they are all here, in one function, each with its reason.
 */
import { existsSync, lstatSync, readlinkSync } from 'node:fs';
import type { SandboxIdentity } from './sandbox-etc.ts';

/** Where the workspace appears inside, as in the VM. */
export const SANDBOX_WORKSPACE = '/work';
/** Where a persistent home (the unsafe-local backend's) appears inside, as in the VM. */
export const SANDBOX_HOME = '/home/tenant';
/** bwrap reads the BPF program from this inherited descriptor (runProcess's first extraInput). */
export const SECCOMP_FD = 3;

/** How the host's root is laid out: merged-/usr links are recreated, old-style dirs bound. */
export interface HostLayout {
  /** e.g. ['/bin', 'usr/bin'] for a merged-/usr host. */
  symlinks: Array<[path: string, target: string]>;
  /** Top-level system dirs that are real directories on this host (non-merged /usr). */
  binds: string[];
  /** /proc entries this kernel has, by how they are covered (see PROC_*). */
  proc: { readOnly: string[]; maskFiles: string[]; maskDirs: string[]; exposed: string[] };
}

const SYSTEM_DIRS = ['/bin', '/sbin', '/lib', '/lib64', '/lib32', '/libx32'];

/*
 * bwrap run by root maps the sandbox user to host uid 0, and the kernel decides some /proc
 * permissions by uid alone: sysctl files are writable by global uid 0 without any
 * capability (measured: kernel.core_pattern written from inside), sysrq-trigger likewise,
 * and 0400 root files are readable. bwrap's own cover of /proc/sys skips it (the directory
 * answers EACCES to its writability probe), so these are covered here, following Docker's
 * read-only and masked /proc paths, plus the 0400 root files that leak kernel layout.
 */
const PROC_READ_ONLY = ['/proc/sys', '/proc/sysrq-trigger', '/proc/fs', '/proc/bus', '/proc/irq'];
const PROC_MASK_FILES = [
  '/proc/kcore', '/proc/keys', '/proc/latency_stats', '/proc/timer_list', '/proc/timer_stats', '/proc/sched_debug',
  '/proc/kmsg', '/proc/kpagecgroup', '/proc/kpagecount', '/proc/kpageflags', '/proc/pagetypeinfo', '/proc/slabinfo',
  '/proc/vmallocinfo',
];
const PROC_MASK_DIRS = ['/proc/acpi', '/proc/asound', '/proc/scsi'];

/*
 * A fast-path run gets no procfs, only a read-only tmpfs /proc holding the host's copies of
 * these pid-independent entries. Why: a procfs shows every process's mount table
 * (/proc/<pid>/mountinfo, mounts, mountstats), and a bind mount's line there names its
 * source as a path inside the source file system: the workspace's host path (the data dir,
 * the session id), the broker's /etc dir; bwrap's own argv (/proc/1/cmdline) repeats them.
 * Per-pid files cannot be masked by mounts (new pids appear under a mounted procfs), the
 * bind's root field cannot be hidden short of giving the workspace its own superblock (an
 * overlay names its dirs in the same line; FUSE costs every read), and seccomp cannot see
 * paths. What the router admits (ls, cat, sed, grep, find, git, wc, sort, ...) was traced
 * (strace -e trace=%file): git reads nothing in /proc; ls, sed, find and stat read
 * /proc/filesystems (libselinux's probe); grep and diff read /proc/self/maps and xargs
 * /proc/self/fd, each only as an optional probe they do without. Lost: /dev/stdin,
 * /dev/stdout, /dev/stderr and /dev/fd/N, links into /proc/self/fd that bash opens even in
 * its own redirections, so the router sends a command naming one to the VM
 * (router/paths.ts; `>&2` names no file and stays here), as it already did process
 * substitution. Nine mounts for /proc instead of
 * seventeen: `cat` in plain bwrap measured 21.5 ms p50 against 24.1 ms with the masked
 * procfs (interleaved A/B, 80 runs each, on a loaded 2-core host). The sysctls stay readable
 * (read-only, as before); the other entries are kernel-wide and show no host paths.
 */
const PROC_EXPOSED = ['/proc/sys', '/proc/filesystems', '/proc/cpuinfo', '/proc/meminfo', '/proc/version'];

export function probeHostLayout(): HostLayout {
  const layout: HostLayout = { symlinks: [], binds: [], proc: { readOnly: [], maskFiles: [], maskDirs: [], exposed: [] } };
  for (const dir of SYSTEM_DIRS) {
    let st;
    try {
      st = lstatSync(dir);
    } catch {
      continue;
    }
    if (st.isSymbolicLink()) layout.symlinks.push([dir, readlinkSync(dir)]);
    else if (st.isDirectory()) layout.binds.push(dir);
  }
  // The sandbox's /proc is the same kernel's: what exists here exists there (bwrap fails on a
  // mount over a path that does not).
  layout.proc.readOnly = PROC_READ_ONLY.filter((p) => existsSync(p));
  layout.proc.maskFiles = PROC_MASK_FILES.filter((p) => existsSync(p));
  layout.proc.maskDirs = PROC_MASK_DIRS.filter((p) => existsSync(p));
  layout.proc.exposed = PROC_EXPOSED.filter((p) => existsSync(p));
  return layout;
}

export interface BwrapSpec {
  bwrap: string;
  workspace: string;
  /** Absolute path inside the sandbox, under /work. */
  cwd: string;
  /** The whole environment of the command; bwrap's own is cleared. */
  env: Record<string, string>;
  etcDir: string;
  /** An empty read-only directory, mounted over masked /proc directories. */
  emptyDir: string;
  identity: SandboxIdentity;
  layout: HostLayout;
  tmpBytes: number;
  command: string;
  /** A host directory bound writable at SANDBOX_HOME (unsafe-local's home that outlives a call). */
  home?: string | undefined;
  /** RLIMIT_FSIZE of the command (the session's remaining workspace quota, capped at the file limit). */
  fileSizeLimitBytes?: number | undefined;
}

export function bwrapArgv(s: BwrapSpec): string[] {
  const a: string[] = [s.bwrap];
  // Namespaces: every one bwrap knows (user, ipc, pid, net, uts, cgroup), the user namespace
  // mandatory, and no further user namespaces inside (a nested `unshare -U` is the usual
  // first step of kernel exploits that need CAP_SYS_ADMIN over something).
  a.push('--unshare-all', '--unshare-user', '--disable-userns');
  // Not root inside: a mapped non-root uid, and no capabilities even in the sandbox's namespaces.
  a.push('--uid', String(s.identity.uid), '--gid', String(s.identity.gid), '--cap-drop', 'ALL');
  // Nothing outlives the call: the sandbox dies with bwrap (and bwrap with the broker's kill);
  // a new session so the command cannot push input into a terminal with TIOCSTI.
  a.push('--die-with-parent', '--new-session');
  a.push('--hostname', 'sandbox');
  a.push('--clearenv');
  for (const [k, v] of Object.entries(s.env)) a.push('--setenv', k, v);

  // The file system: the host's /usr read-only, a generated /etc, private /proc, /dev and
  // /tmp, and the workspace, which is the only host directory that can be written.
  a.push('--ro-bind', '/usr', '/usr');
  for (const [path, target] of s.layout.symlinks) a.push('--symlink', target, path);
  for (const dir of s.layout.binds) a.push('--ro-bind', dir, dir);
  a.push('--ro-bind', s.etcDir, '/etc');
  // Read-only binds take the host's entry as source (bwrap resolves sources outside); for
  // /proc/sys that is the same kernel tables, and net.* still follows the reader's netns.
  if (s.home === undefined) {
    // The fast path: no procfs (see PROC_EXPOSED for why and what is lost).
    a.push('--perms', '0555', '--tmpfs', '/proc');
    for (const p of s.layout.proc.exposed) a.push('--ro-bind', p, p);
    a.push('--remount-ro', '/proc');
  } else {
    // unsafe-local stands for a VM, where tenants run anything (ps, /dev/fd, process
    // substitution), so it keeps a real procfs, covered as Docker covers it; its mount
    // table shows the workspace's and home's host paths (README: what it does not isolate).
    a.push('--proc', '/proc');
    for (const p of s.layout.proc.readOnly) a.push('--ro-bind', p, p);
    for (const p of s.layout.proc.maskFiles) a.push('--ro-bind', '/dev/null', p);
    for (const p of s.layout.proc.maskDirs) a.push('--ro-bind', s.emptyDir, p);
  }
  a.push('--dev', '/dev');
  a.push('--size', String(s.tmpBytes), '--tmpfs', '/tmp');
  a.push('--bind', s.workspace, SANDBOX_WORKSPACE, '--chdir', s.cwd);
  // HOME: unsafe-local's persistent one, else an empty directory of the read-only root.
  if (s.home !== undefined) a.push('--bind', s.home, SANDBOX_HOME);
  else a.push('--perms', '0555', '--dir', SANDBOX_HOME);
  // bwrap's root and /dev are writable tmpfs; read-only, so only /work and /tmp take writes
  // (the device nodes are their own bind mounts: /dev/null stays writable).
  a.push('--remount-ro', '/dev', '--remount-ro', '/');

  a.push('--seccomp', String(SECCOMP_FD));
  // RLIMIT_FSIZE by bash's own ulimit (no extra exec; prlimit would cost ~3 ms a call): without
  // -S/-H it sets soft and hard, and raising a hard limit needs CAP_SYS_RESOURCE, which the
  // sandbox lacks. Same line, so the tenant's line numbers hold. (BASH_ENV would run first;
  // the router sends such env to the VM, and the broker's usage watch still bounds it.)
  const limit = s.fileSizeLimitBytes === undefined ? '' : `ulimit -f ${Math.floor(s.fileSizeLimitBytes / 1024)}; `;
  a.push('--', '/bin/bash', '-c', limit + s.command);
  return a;
}
