import { readdirSync, readFileSync, rmSync, existsSync } from 'node:fs';
import type { Logger } from '../../../guest-agent/src/log.ts';
import { QEMU_TAG } from './qemu-driver.ts';

/**
 * Kills QEMU processes a previous broker left behind under `runRoot` and removes their
 * runtime files. VMs are tagged in their command line (-name hutch-vm:ID) and keep their
 * files under the broker's run directory, so only this broker's VMs are touched.
 */
export function cleanupOrphans(runRoot: string, log: Logger): { killed: number; removed: boolean } {
  let killed = 0;
  for (const pid of readdirSync('/proc')) {
    if (!/^\d+$/.test(pid) || Number(pid) === process.pid) continue;
    let cmdline: string;
    try {
      cmdline = readFileSync(`/proc/${pid}/cmdline`, 'utf8');
    } catch {
      continue;
    }
    // QEMU (tagged) and its vhost-user vsock backend, both with files under our run directory.
    const ours = (cmdline.includes(`${QEMU_TAG}:`) || cmdline.includes('vhost-device-vsock')) && cmdline.includes(`${runRoot}/`);
    if (!ours) continue;
    try {
      process.kill(Number(pid), 'SIGKILL');
      killed++;
      log.warn('vm.orphan_killed', { pid: Number(pid) });
    } catch {
      // gone already
    }
  }
  const removed = existsSync(runRoot);
  rmSync(runRoot, { recursive: true, force: true });
  return { killed, removed };
}
