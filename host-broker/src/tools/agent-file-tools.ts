import type { FileTools } from '../../../guest-agent/src/workspace/file-tools.ts';
import type { AgentClient } from '../agent-client.ts';

/** The file tools the harness can call, whoever runs them. */
export type FileToolTarget = Pick<FileTools, 'read' | 'write' | 'edit' | 'glob' | 'grep' | 'list'>;

/**
 * The same file tools answered by the guest agent (fs.* calls), for when routing is off
 * and every call runs in the VM: the agent runs the very FileTools the broker runs in-process.
 */
export function agentFileTools(agent: AgentClient): FileToolTarget {
  return {
    read: (p) => agent.call('fs.read', p),
    write: (p) => agent.call('fs.write', p),
    edit: (p) => agent.call('fs.edit', p),
    glob: (p) => agent.call('fs.glob', p),
    grep: (p) => agent.call('fs.grep', p),
    list: (p) => agent.call('fs.list', p),
  };
}
