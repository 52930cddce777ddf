/**
 * What a booted guest looks like from the broker's side: facts gathered
 * through the agent alone (tenant commands and file calls), for the rootfs
 * test and `rootfs/verify.ts`. Everything here runs as the tenant, so it also
 * shows what the tenant can and cannot do.
 */
import type { AgentClient } from "../host-broker/src/agent-client.ts";

/** Where init keeps the overlay's upper layer: non-empty means the VM is dirty. */
export const OVERLAY_UPPER = "/run/hutch/overlay/upper";

/** Shell that lists the overlay upper's top level, one name per line (empty output = clean). */
export const DIRTY_CHECK = `ls -A ${OVERLAY_UPPER}`;

export interface Timing {
  /** Wall seconds measured inside the guest (bash's `time`). */
  first: number;
  second: number;
}

export interface GuestFacts {
  idLine: string;
  uid: number;
  pythonOut: string;
  nodeOut: string;
  rootFsType: string;
  workFsType: string;
  tmpFsType: string;
  upperAtStart: string[];
  upperAfterWorkAndTmp: string[];
  upperAfterHome: string[];
  /** stderr of a tenant's write to /etc (expected: permission denied, not read-only). */
  etcWriteError: string;
  swaps: string[];
  zswap: { enabled: string; compressor: string; zpool: string };
  cgroupSubtreeControl: string[];
  workloadPidsMax: string;
  agentCgroup: string;
  tenantCgroup: string;
  vportModes: string[];
  /** stderr of the tenant trying to open the agent's port. */
  vportOpenError: string;
  /** stderr of the tenant trying to signal the agent. */
  killAgentError: string;
  nprocLimit: string;
  kernelRelease: string;
  memTotalKiB: number;
}

export class ExecFailed extends Error {
  constructor(command: string, exitCode: number | null, stderr: string) {
    super(`guest command failed (exit ${exitCode}): ${command}\n${stderr.trim().slice(-2000)}`);
    this.name = "ExecFailed";
  }
}

/** Runs a tenant shell command, failing with its stderr if it exits non-zero. */
export async function sh(client: AgentClient, command: string, timeoutMs = 120_000): Promise<string> {
  const r = await client.run({ command, timeoutMs });
  if (r.exitCode !== 0) throw new ExecFailed(command, r.exitCode, r.stderrText);
  return r.stdoutText;
}

/** `key=value` lines -> map (values may contain '='). */
function parseKv(text: string): Map<string, string> {
  const m = new Map<string, string>();
  for (const line of text.split("\n")) {
    const i = line.indexOf("=");
    if (i > 0) m.set(line.slice(0, i), line.slice(i + 1));
  }
  return m;
}

function lines(s: string): string[] {
  return s.split("\n").map((l) => l.trim()).filter(Boolean);
}

/** Times `command` twice in a row inside the guest (wall seconds from bash's `time`). */
export async function timeTwice(client: AgentClient, command: string): Promise<Timing> {
  const script = `TIMEFORMAT=%R; for i in 1 2; do { time ${command} >/dev/null; } 2>&1; done`;
  const out = lines(await sh(client, script)).map(Number);
  const [first, second] = out;
  if (first === undefined || second === undefined || !Number.isFinite(first) || !Number.isFinite(second)) {
    throw new Error(`cannot parse timings of ${command}: ${JSON.stringify(out)}`);
  }
  return { first, second };
}

/**
 * Gathers the facts. Writes a file to /work, /tmp and the tenant's home on the
 * way (in that order, checking the overlay between), so run it on a fresh VM.
 */
export async function gatherFacts(client: AgentClient, agentPid: number): Promise<GuestFacts> {
  const upperAtStart = lines(await sh(client, DIRTY_CHECK));
  await sh(client, "mkdir -p /work/hutch-facts && echo from-a-command > /work/hutch-facts/by-command.txt && echo tmp > /tmp/hutch-facts.txt");
  await client.call("fs.write", { path: "hutch-facts/written-by-fs-write.txt", content: "via the agent\n" });
  const upperAfterWorkAndTmp = lines(await sh(client, DIRTY_CHECK));
  await sh(client, "echo home > ~/hutch-facts.txt");
  const upperAfterHome = lines(await sh(client, DIRTY_CHECK));

  const script = [
    'echo "id=$(id)"',
    'echo "uid=$(id -u)"',
    'echo "python=$(python3 -c "print(1)")"',
    'echo "node=$(node -e "console.log(2)")"',
    'echo "rootfs=$(stat -f -c %T /)"',
    'echo "workfs=$(stat -f -c %T /work)"',
    'echo "tmpfs=$(stat -f -c %T /tmp)"',
    'echo "etc=$( (echo x > /etc/hutch-facts) 2>&1 )"',
    'echo "swaps=$(tail -n +2 /proc/swaps | awk \'{print $1}\' | tr "\\n" " ")"',
    'z=/sys/module/zswap/parameters',
    'echo "zswap_enabled=$(cat $z/enabled 2>/dev/null)"',
    'echo "zswap_compressor=$(cat $z/compressor 2>/dev/null)"',
    'echo "zswap_zpool=$(cat $z/zpool 2>/dev/null)"',
    'echo "subtree=$(cat /sys/fs/cgroup/cgroup.subtree_control)"',
    'echo "pidsmax=$(cat /sys/fs/cgroup/workload/pids.max 2>/dev/null)"',
    `echo "agentcg=$(cat /proc/${agentPid}/cgroup)"`,
    'echo "selfcg=$(cat /proc/self/cgroup)"',
    'echo "vportmodes=$(stat -c %a /dev/vport* | tr "\\n" " ")"',
    'echo "vportopen=$( (for p in /dev/vport*p*; do : < "$p"; done) 2>&1 | head -1)"',
    `echo "kill=$( (kill -0 ${agentPid}) 2>&1)"`,
    'echo "nproc=$(ulimit -u)"',
    'echo "kernel=$(uname -r)"',
    "echo \"memtotal=$(awk '/MemTotal/ {print $2}' /proc/meminfo)\"",
  ].join("\n");
  const kv = parseKv(await sh(client, script));
  const get = (k: string): string => kv.get(k) ?? "";
  return {
    idLine: get("id"),
    uid: Number(get("uid")),
    pythonOut: get("python"),
    nodeOut: get("node"),
    rootFsType: get("rootfs"),
    workFsType: get("workfs"),
    tmpFsType: get("tmpfs"),
    upperAtStart,
    upperAfterWorkAndTmp,
    upperAfterHome,
    etcWriteError: get("etc"),
    swaps: get("swaps").split(" ").filter(Boolean),
    zswap: { enabled: get("zswap_enabled"), compressor: get("zswap_compressor"), zpool: get("zswap_zpool") },
    cgroupSubtreeControl: get("subtree").split(" ").filter(Boolean),
    workloadPidsMax: get("pidsmax"),
    agentCgroup: get("agentcg"),
    tenantCgroup: get("selfcg"),
    vportModes: get("vportmodes").split(" ").filter(Boolean),
    vportOpenError: get("vportopen"),
    killAgentError: get("kill"),
    nprocLimit: get("nproc"),
    kernelRelease: get("kernel"),
    memTotalKiB: Number(get("memtotal")),
  };
}
