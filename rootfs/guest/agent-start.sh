#!/bin/sh
# Run by tini (PID 1): starts the hutch agent as root in the agent cgroup and
# prints HUTCH_READY <uptime> on the console once it is listening, so the host
# can time boots and knows when to snapshot. If the agent exits, so does this
# script, then tini, and the kernel stops the VM: a sandbox without its agent
# is of no use, and the host sees the VM go away.
# Runs from the agent layer (/opt/hutch) under its busybox sh. The template's tools first
# (what the agent runs as root, e.g. `mount -o remount` on a restore), the layer's busybox
# as the fallback for templates without them.
PATH=/usr/sbin:/usr/bin:/sbin:/bin:/opt/hutch/bin
export PATH

listen=vport:hutch-agent
nproc=4096
agent_log_level=info
while IFS='=' read -r key val; do
  case "$key" in
    listen) listen=$val ;;
    nproc) nproc=$val ;;
    agent_log_level) agent_log_level=$val ;;
  esac
done < /run/hutch/settings

# The agent and everything it starts begin in the agent cgroup.
echo $$ > /sys/fs/cgroup/agent/cgroup.procs || echo "HUTCH_WARN cannot join the agent cgroup"
# RLIMIT_NPROC (busybox ash: ulimit -u) caps processes per real uid; root ignores it, so the agent is
# unaffected while tenant commands (which inherit it) cannot fork without bound.
ulimit -u "$nproc" 2>/dev/null || echo "HUTCH_WARN cannot set RLIMIT_NPROC to $nproc"

# Options this agent build understands beyond the basics (written at image build time).
set --
if [ -r /opt/hutch/agent-flags ]; then
  while IFS= read -r flag; do
    [ -n "$flag" ] && set -- "$@" "$flag"
  done < /opt/hutch/agent-flags
fi

# The template's --env pairs (KEY=VALUE lines) reach tenant commands through the agent.
if [ -r /etc/hutch/env ]; then
  while IFS= read -r kv; do
    case "$kv" in *=*) set -- "$@" "--env=$kv" ;; esac
  done < /etc/hutch/env
fi

# The agent's log lines go to the console. The first "agent.listening" line is
# the readiness signal; after that the loop just copies lines through.
# Node from the agent layer, with the layer's own glibc and libraries (bin/node loads
# them through the layer's dynamic loader): the template's libc is never involved.
/opt/hutch/bin/node /opt/hutch/hutch-agent.mjs --listen "$listen" --root /work --mount-point /work \
  --run-as 1000:1000 --log-level "$agent_log_level" "$@" 2>&1 | {
  ready=0
  while IFS= read -r line; do
    printf '%s\n' "$line"
    if [ "$ready" = 0 ]; then
      case "$line" in
        *'"agent.listening"'*)
          ready=1
          read -r up _ < /proc/uptime
          echo "HUTCH_READY $up"
          exec cat
          ;;
      esac
    fi
  done
}
# In a pipeline the status is the last command's; the agent's own is lost, which is fine: any exit is fatal.
echo "HUTCH_AGENT_EXITED"
exit 1
