/*
 * hutch-spawn CGROUP_PROCS UID GID -- COMMAND [ARG...]
 *
 * Starts a tenant command already inside its cgroup: joins the cgroup (writing "0" to its
 * cgroup.procs moves the writer), drops supplementary groups, then gid, then uid, and
 * execs. The agent cannot do this from Node (no CLONE_INTO_CGROUP, no hook between fork
 * and exec), and moving the child after spawn races with everything it forks first: those
 * processes would stay in the agent's cgroup, out of reach of pids.max and memory.reclaim.
 * Exit status 127 (with a message) when any step fails, like a shell that cannot run a command.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int fail(const char *what, const char *detail) {
	fprintf(stderr, "hutch-spawn: %s %s: %s\n", what, detail, strerror(errno));
	return 127;
}

static int parse_id(const char *s, unsigned long *out) {
	char *end;
	errno = 0;
	*out = strtoul(s, &end, 10);
	return errno == 0 && *s != '\0' && *end == '\0' && *out < 0xffffffffUL;
}

int main(int argc, char **argv) {
	unsigned long uid, gid;
	if (argc < 6 || strcmp(argv[4], "--") != 0 || !parse_id(argv[2], &uid) || !parse_id(argv[3], &gid)) {
		fprintf(stderr, "usage: hutch-spawn CGROUP_PROCS UID GID -- COMMAND [ARG...]\n");
		return 127;
	}
	int fd = open(argv[1], O_WRONLY | O_CLOEXEC);
	if (fd < 0) return fail("open", argv[1]);
	if (write(fd, "0", 1) != 1) return fail("join cgroup", argv[1]);
	close(fd);
	if (setgroups(0, NULL) != 0) return fail("setgroups", "[]");
	if (setgid((gid_t)gid) != 0) return fail("setgid", argv[3]);
	if (setuid((uid_t)uid) != 0) return fail("setuid", argv[2]);
	execvp(argv[5], &argv[5]);
	return fail("exec", argv[5]);
}
