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
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/random.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define MAX_ENTROPY 4096

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: hutch-resume UNIX_MS MONO_NS < entropy\n");
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

  struct rand_pool_info *info = malloc(sizeof(*info) + MAX_ENTROPY);
  if (!info) return 1;
  size_t n = 0;
  while (n < MAX_ENTROPY) {
    ssize_t r = read(0, (unsigned char *)info->buf + n, MAX_ENTROPY - n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    n += (size_t)r;
  }
  char reseed[96] = "ok";
  if (n < 32) {
    snprintf(reseed, sizeof reseed, "only %zu bytes of entropy", n);
  } else {
    int fd = open("/dev/urandom", O_RDWR | O_CLOEXEC);
    info->entropy_count = (int)(n * 8);
    info->buf_size = (int)n;
    if (fd < 0) snprintf(reseed, sizeof reseed, "open /dev/urandom: %s", strerror(errno));
    else if (ioctl(fd, RNDADDENTROPY, info) != 0) snprintf(reseed, sizeof reseed, "RNDADDENTROPY: %s", strerror(errno));
    else if (ioctl(fd, RNDRESEEDCRNG) != 0) snprintf(reseed, sizeof reseed, "RNDRESEEDCRNG: %s", strerror(errno));
    if (fd >= 0) close(fd);
  }
  free(info);

  char clock[96] = "ok";
  struct timespec mono;
  if (clock_gettime(CLOCK_MONOTONIC, &mono) != 0) {
    snprintf(clock, sizeof clock, "clock_gettime: %s", strerror(errno));
  } else {
    long long now_ns = (long long)mono.tv_sec * 1000000000LL + mono.tv_nsec;
    long long elapsed_us = now_ns > mono_then ? (now_ns - mono_then) / 1000 : 0;
    long long target_us = unix_ms * 1000 + elapsed_us;
    struct timeval tv = { .tv_sec = target_us / 1000000, .tv_usec = target_us % 1000000 };
    if (settimeofday(&tv, NULL) != 0) snprintf(clock, sizeof clock, "settimeofday: %s", strerror(errno));
  }
  printf("reseed=%s clock=%s\n", reseed, clock);
  return strcmp(reseed, "ok") == 0 && strcmp(clock, "ok") == 0 ? 0 : 1;
}
