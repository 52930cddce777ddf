/**
 * What the npm package's `hutch` CLI has instead of the guest image builders. The package
 * carries what a harness needs (the SDK, the broker, the prebuilt agent bundle), not the
 * kernel and rootfs builders (debootstrap, a kernel tree, the agent's sources): the local
 * backend runs the bundled agent, and the qemu backend needs a clone of the repository
 * (`./hutch setup` builds and caches the guest image there).
 */
import { createHash } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { HutchError } from '../../guest-agent/src/protocol/errors.ts';

/** Next to the bundled CLI in dist/. */
export const AGENT_BUNDLE = fileURLToPath(new URL('./hutch-agent.mjs', import.meta.url));

export async function buildAgent(): Promise<{ path: string; sha256: string; bytes: number }> {
  const bytes = readFileSync(AGENT_BUNDLE);
  return { path: AGENT_BUNDLE, sha256: createHash('sha256').update(bytes).digest('hex'), bytes: bytes.length };
}

function noBuilder(): never {
  throw new HutchError(
    'unavailable',
    'this installed hutch package has no guest image builder; run the qemu backend from a clone of the hutch repository (./hutch setup builds the guest image), or serve with the local backend',
  );
}

export const ensureRootfs = async (): Promise<never> => noBuilder();
export const ensureKernel = async (): Promise<never> => noBuilder();
export const ensureDebianKernel = async (): Promise<never> => noBuilder();
