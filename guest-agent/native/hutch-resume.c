/*
 * hutch-resume: run by the agent right after a snapshot restore.
 *
 *   hutch-resume UNIX_MS MONO_NS   (32..4096 bytes of entropy on stdin)
 *
 * Every VM restored from one snapshot starts with the same kernel RNG state and the clock
 * of the moment the snapshot was taken. Writing to /dev/urandom only mixes bytes into the
 * input pool: the CRNG that getrandom() reads keeps its key until its next scheduled
 * reseed, which clones reach at the same moment with the same pool, so clones would hand
 * out the same "random" bytes for up to a minute. So: add the broker's entropy with
 * RNDADDENTROPY, then force a reseed with RNDRESEEDCRNG (both need CAP_SYS_ADMIN; the agent
 * is root). Then set the clock to the broker's time plus what passed on this guest's
 * monotonic clock since the agent received it (MONO_NS is CLOCK_MONOTONIC then), so the
 * process start itself (slow under TCG) does not leave the clock behind.
 *
 * Prints one line: "reseed=ok|<errno text> clock=ok|<errno text>"; exit 0 when both worked.
 *
 *   hutch-resume --serve
 *
 * The same, as a resident process the agent starts before the snapshot is taken: after a
 * restore the agent writes one request line and reads one answer line, so no process is
 * forked and exec'd on the wake's critical path (the first fork after a restore costs
 * hundreds of ms under TCG, a fork of the large agent process most of all). A request is
 *   UNIX_MS MONO_NS ENTROPY_HEX WORK_BYTES WORK_FILES\n
 * (WORK_BYTES 0: leave /work as it is; else remount the tmpfs at /work with that size and
 * that many inodes, keeping its nosuid/nodev/noexec flags), and the answer
 *   reseed=ok|<text> clock=ok|<text> work=ok|skipped|<text>\n
 * Text in an answer has no spaces (they become '_'), so the agent can split on them.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/random.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/statvfs.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define MAX_ENTROPY 4096
#define MSG 96

/* The broker's entropy into the input pool, then a forced CRNG reseed. */
static void reseed(const unsigned char *bytes, size_t n, char *out) {
  snprintf(out, MSG, "ok");
  if (n < 32) {
    snprintf(out, MSG, "only %zu bytes of entropy", n);
    return;
  }
  struct rand_pool_info *info = malloc(sizeof(*info) + MAX_ENTROPY);
  if (!info) {
    snprintf(out, MSG, "out of memory");
    return;
  }
  memcpy(info->buf, bytes, n);
  info->entropy_count = (int)(n * 8);
  info->buf_size = (int)n;
  int fd = open("/dev/urandom", O_RDWR | O_CLOEXEC);
  if (fd < 0) snprintf(out, MSG, "open /dev/urandom: %s", strerror(errno));
  else if (ioctl(fd, RNDADDENTROPY, info) != 0) snprintf(out, MSG, "RNDADDENTROPY: %s", strerror(errno));
  else if (ioctl(fd, RNDRESEEDCRNG) != 0) snprintf(out, MSG, "RNDRESEEDCRNG: %s", strerror(errno));
  if (fd >= 0) close(fd);
  free(info);
}

/* The clock to the broker's time plus what passed here since the agent received it. */
static void set_clock(long long unix_ms, long long mono_then, char *out) {
  snprintf(out, MSG, "ok");
  struct timespec mono;
  if (clock_gettime(CLOCK_MONOTONIC, &mono) != 0) {
    snprintf(out, MSG, "clock_gettime: %s", strerror(errno));
    return;
  }
  long long now_ns = (long long)mono.tv_sec * 1000000000LL + mono.tv_nsec;
  long long elapsed_us = now_ns > mono_then ? (now_ns - mono_then) / 1000 : 0;
  long long target_us = unix_ms * 1000 + elapsed_us;
  struct timeval tv = { .tv_sec = target_us / 1000000, .tv_usec = target_us % 1000000 };
  if (settimeofday(&tv, NULL) != 0) snprintf(out, MSG, "settimeofday: %s", strerror(errno));
}

/* Resizes the /work tmpfs; the flags it was mounted with are kept (a remount without them would drop nosuid). */
static void size_work(long long bytes, long long files, char *out) {
  snprintf(out, MSG, "ok");
  struct statvfs st;
  if (statvfs("/work", &st) != 0) {
    snprintf(out, MSG, "statvfs /work: %s", strerror(errno));
    return;
  }
  unsigned long flags = MS_REMOUNT;
  if (st.f_flag & ST_NOSUID) flags |= MS_NOSUID;
  if (st.f_flag & ST_NODEV) flags |= MS_NODEV;
  if (st.f_flag & ST_NOEXEC) flags |= MS_NOEXEC;
  if (st.f_flag & ST_RDONLY) flags |= MS_RDONLY;
  if (st.f_flag & ST_NOATIME) flags |= MS_NOATIME;
  if (st.f_flag & ST_NODIRATIME) flags |= MS_NODIRATIME;
  if (st.f_flag & ST_RELATIME) flags |= MS_RELATIME;
  char data[96];
  snprintf(data, sizeof data, "size=%lld,nr_inodes=%lld", bytes, files);
  if (mount("work", "/work", "tmpfs", flags, data) != 0) snprintf(out, MSG, "remount /work: %s", strerror(errno));
}

static void no_spaces(char *s) {
  for (; *s; s++)
    if (*s == ' ' || *s == '\n') *s = '_';
}

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

static int serve(void) {
  static char line[2 * MAX_ENTROPY + 256];
  static unsigned char entropy[MAX_ENTROPY];
  while (fgets(line, sizeof line, stdin)) {
    char r[MSG], c[MSG], w[MSG];
    long long unix_ms = 0, mono_then = -1, work_bytes = 0, work_files = 0;
    char hex[2 * MAX_ENTROPY + 1];
    hex[0] = 0;
    size_t n = 0;
    if (sscanf(line, "%lld %lld %8192s %lld %lld", &unix_ms, &mono_then, hex, &work_bytes, &work_files) != 5 || unix_ms <= 0 || mono_then < 0) {
      printf("reseed=bad_request clock=bad_request work=bad_request\n");
      fflush(stdout);
      continue;
    }
    size_t len = strlen(hex);
    for (size_t i = 0; i + 1 < len && n < MAX_ENTROPY; i += 2) {
      int hi = hexval(hex[i]), lo = hexval(hex[i + 1]);
      if (hi < 0 || lo < 0) break;
      entropy[n++] = (unsigned char)(hi * 16 + lo);
    }
    reseed(entropy, n, r);
    set_clock(unix_ms, mono_then, c);
    if (work_bytes > 0) size_work(work_bytes, work_files, w);
    else snprintf(w, MSG, "skipped");
    memset(entropy, 0, sizeof entropy);
    no_spaces(r);
    no_spaces(c);
    no_spaces(w);
    printf("reseed=%s clock=%s work=%s\n", r, c, w);
    fflush(stdout);
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc == 2 && strcmp(argv[1], "--serve") == 0) return serve();
  if (argc != 3) {
    fprintf(stderr, "usage: hutch-resume UNIX_MS MONO_NS < entropy | hutch-resume --serve\n");
    return 2;
  }
  char *end = NULL;
  long long unix_ms = strtoll(argv[1], &end, 10);
  if (!end || *end || unix_ms <= 0) {
    fprintf(stderr, "hutch-resume: bad UNIX_MS %s\n", argv[1]);
    return 2;
  }
  long long mono_then = strtoll(argv[2], &end, 10);
  if (!end || *end || mono_then < 0) {
    fprintf(stderr, "hutch-resume: bad MONO_NS %s\n", argv[2]);
    return 2;
  }
  static unsigned char entropy[MAX_ENTROPY];
  size_t n = 0;
  while (n < MAX_ENTROPY) {
    ssize_t r = read(0, entropy + n, MAX_ENTROPY - n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    n += (size_t)r;
  }
  char r[MSG], c[MSG];
  reseed(entropy, n, r);
  set_clock(unix_ms, mono_then, c);
  printf("reseed=%s clock=%s\n", r, c);
  return strcmp(r, "ok") == 0 && strcmp(c, "ok") == 0 ? 0 : 1;
}
