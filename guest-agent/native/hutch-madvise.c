/*
 * hutch-madvise: process_madvise(2) of address ranges in other processes, for the
 * hutch agent's prefetch on wake (MADV_WILLNEED of a recorded activation set) and
 * page-out experiments (MADV_PAGEOUT, MADV_COLD).
 *
 * Node cannot make these system calls itself, and a Python ctypes helper would pay
 * ~0.3 s of interpreter start under TCG on every wake; this is a few KiB of static code
 * that starts in about a millisecond.
 *
 * usage: hutch-madvise willneed|pageout|cold < RANGES
 *   RANGES: one "PID START LENGTH" per line (START and LENGTH in hex, page aligned),
 *           grouped by PID.
 * Output: one JSON object per PID on stdout:
 *   {"pid":P,"ranges":N,"bytes":B,"advised":A,"failed":F,"errno":E}
 * where advised counts bytes the kernel accepted and failed the ranges it refused
 * (errno is the last error, 0 if none). Exit status 0 unless the input was malformed
 * or a syscall is missing (then 2, with a message on stderr).
 *
 * Needs CAP_SYS_NICE and ptrace-read access to the target (the agent runs as root).
 * Built statically by rootfs/image.ts with the host's gcc; no libc features beyond
 * syscall(2) and stdio are used.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_process_madvise
#define SYS_process_madvise 440
#endif
#ifndef MADV_COLD
#define MADV_COLD 20
#endif
#ifndef MADV_PAGEOUT
#define MADV_PAGEOUT 21
#endif

/* The kernel takes at most UIO_MAXIOV (1024) iovecs per call. */
#define BATCH 1024

struct pid_state {
  long pid;
  int pidfd;
  int open_errno;
  unsigned long ranges, bytes, advised, failed;
  int last_errno;
  struct iovec iov[BATCH];
  int n;
};

static int advice;

static long madvise_vec(int pidfd, struct iovec *iov, int n) {
  return syscall(SYS_process_madvise, pidfd, iov, (size_t)n, advice, 0u);
}

/* One batch; when the kernel stops at a range it refuses (unmapped since it was
 * recorded, ENOMEM), the rest are retried one by one so one stale range costs only
 * itself. */
static void flush(struct pid_state *s) {
  if (s->n == 0) return;
  if (s->pidfd < 0) {
    s->failed += (unsigned long)s->n;
    s->last_errno = s->open_errno;
    s->n = 0;
    return;
  }
  long r = madvise_vec(s->pidfd, s->iov, s->n);
  unsigned long total = 0;
  for (int i = 0; i < s->n; i++) total += s->iov[i].iov_len;
  if (r >= 0 && (unsigned long)r == total) {
    s->advised += total;
  } else {
    if (r < 0) s->last_errno = errno;
    for (int i = 0; i < s->n; i++) {
      long one = madvise_vec(s->pidfd, &s->iov[i], 1);
      if (one < 0) {
        if (errno == ENOSYS) {
          fprintf(stderr, "hutch-madvise: process_madvise: %s\n", strerror(errno));
          exit(2);
        }
        s->failed++;
        s->last_errno = errno;
      } else {
        s->advised += (unsigned long)one;
      }
    }
  }
  s->n = 0;
}

static void finish(struct pid_state *s) {
  if (s->pid <= 0) return;
  flush(s);
  printf("{\"pid\":%ld,\"ranges\":%lu,\"bytes\":%lu,\"advised\":%lu,\"failed\":%lu,\"errno\":%d}\n", s->pid, s->ranges,
         s->bytes, s->advised, s->failed, s->last_errno);
  if (s->pidfd >= 0) close(s->pidfd);
  s->pid = 0;
}

static void start(struct pid_state *s, long pid) {
  memset(s, 0, sizeof *s);
  s->pid = pid;
  s->pidfd = (int)syscall(SYS_pidfd_open, (pid_t)pid, 0u);
  if (s->pidfd < 0) {
    s->open_errno = errno;
    if (errno == ENOSYS) {
      fprintf(stderr, "hutch-madvise: pidfd_open: %s\n", strerror(errno));
      exit(2);
    }
  }
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: hutch-madvise willneed|pageout|cold < 'PID START_HEX LEN_HEX' lines\n");
    return 2;
  }
  if (strcmp(argv[1], "willneed") == 0) advice = MADV_WILLNEED;
  else if (strcmp(argv[1], "pageout") == 0) advice = MADV_PAGEOUT;
  else if (strcmp(argv[1], "cold") == 0) advice = MADV_COLD;
  else {
    fprintf(stderr, "hutch-madvise: unknown advice %s (willneed, pageout, cold)\n", argv[1]);
    return 2;
  }
  static struct pid_state s;
  char line[128];
  unsigned long lineno = 0;
  while (fgets(line, sizeof line, stdin)) {
    lineno++;
    long pid;
    unsigned long addr, len;
    if (sscanf(line, "%ld %lx %lx", &pid, &addr, &len) != 3 || pid <= 0 || len == 0 || (addr & 4095) || (len & 4095)) {
      fprintf(stderr, "hutch-madvise: line %lu: expected 'PID START_HEX LEN_HEX' (page aligned)\n", lineno);
      return 2;
    }
    if (pid != s.pid) {
      finish(&s);
      start(&s, pid);
    }
    s.ranges++;
    s.bytes += len;
    s.iov[s.n].iov_base = (void *)addr;
    s.iov[s.n].iov_len = len;
    if (++s.n == BATCH) flush(&s);
  }
  finish(&s);
  return 0;
}
