/**
 * Runs one workspace pull in its own process so a test can SIGKILL it at a chosen point
 * (test/sync-crash.test.ts). Arguments: agent socket, host workspace, state dir, marker,
 * hook point (staged | committed | applying | none), and for `applying` how many applied
 * operations to wait for. Prints HOOK and hangs at the point, or DONE when the pull ends.
 */
import { AgentClient } from '../../host-broker/src/agent-client.ts';
import { Workspace } from '../../guest-agent/src/workspace/confine.ts';
import { WorkspaceMirror } from '../../host-broker/src/sync/workspace-mirror.ts';
import type { PullHookPoint } from '../../host-broker/src/sync/pull-journal.ts';

const [socket, root, stateDir, marker, point, after] = process.argv.slice(2) as [string, string, string, string, PullHookPoint | 'none', string | undefined];
const client = await AgentClient.connectUnix(socket);
const mirror = new WorkspaceMirror(new Workspace(root), undefined, {
  stateDir,
  hook: async (p, detail) => {
    if (p !== point) return;
    if (p === 'applying' && (detail.applied ?? 0) < Number(after ?? 0)) return;
    process.stdout.write('HOOK\n');
    await new Promise(() => undefined); // wait here for the SIGKILL
  },
});
await mirror.pull(client, marker, 1 << 20);
process.stdout.write('DONE\n');
client.close();
