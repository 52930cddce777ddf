import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { Logger } from '../../guest-agent/src/log.ts';
import type { AgentClient } from '../../host-broker/src/agent-client.ts';
import { QemuBackend } from '../../host-broker/src/backends/qemu-backend.ts';
import { cacheDir } from '../../host-broker/src/backends/registry.ts';
import { connectAgent } from '../../host-broker/src/vm/agent-channel.ts';
import type { Vm } from '../../host-broker/src/vm/vmm.ts';

export interface MemoryVm {
  backend: QemuBackend;
  vm: Vm;
  agent: AgentClient;
  close(): Promise<void>;
}

/**
 * A cold-booted VM for the memory tests (anonymous guest RAM: free page reporting of a
 * file-backed RAM block would punch holes into the pristine memory file, see
 * guest-agent/src/memory/page-reporting.ts), with its agent connected.
 */
export async function bootMemoryVm(id: string, log: Logger, size = { memoryMiB: 512, cpus: 1, swapMiB: 512 }): Promise<MemoryVm> {
  const dataDir = mkdtempSync(join(tmpdir(), `hutch-${id}-test-`));
  const backend = await QemuBackend.create({ dataDir, cacheDir: cacheDir(), log });
  const vm = await backend.driver.boot({ id, dir: join(dataDir, 'vms', id), image: backend.image, ...size });
  const agent = await connectAgent(vm, { timeoutMs: 300_000, log });
  return {
    backend,
    vm,
    agent,
    async close() {
      agent.close();
      await vm.destroy();
      await backend.shutdown();
      rmSync(dataDir, { recursive: true, force: true });
    },
  };
}
