#!/opt/hutch/bin/sh
# GIT_PROXY_COMMAND for git:// in a sandbox: the VM has no NIC, so the connection goes
# through the agent's proxy port as a CONNECT tunnel (the broker decides it like any other).
# git runs it as: git-proxy HOST PORT
host=$1
port=$2
proxy_port=${HUTCH_PROXY_PORT:-3128}
if command -v socat >/dev/null 2>&1; then
  exec socat - "PROXY:127.0.0.1:$host:$port,proxyport=$proxy_port"
fi
echo "git-proxy: socat is not in this template; use https:// URLs (they go through https_proxy)" >&2
exit 1
