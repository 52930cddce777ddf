/**
 * What the npm package's `hutch` CLI has instead of the guest image builders. The package
 * carries what a harness needs (the SDK and the broker), not the kernel and rootfs builders
 * (debootstrap, a kernel tree, the agent's sources): its `hutch serve` runs the
 * unsafe-local backend, and the qemu backend needs a clone of the repository
 * (`./hutch setup` builds and caches the guest image there).
 */
import { HutchError } from '../../guest-agent/src/protocol/errors.ts';

function noBuilder(): never {
  throw new HutchError(
    'unavailable',
    'this installed hutch package has no guest image builder; run the qemu backend from a clone of the hutch repository (./hutch setup builds the guest image), or serve with --backend unsafe-local',
  );
}

export const ensureRootfs = async (): Promise<never> => noBuilder();
export const ensureAgentLayer = async (): Promise<never> => noBuilder();
export const debootstrapTarball = async (): Promise<never> => noBuilder();
export const ensureKernel = async (): Promise<never> => noBuilder();
export const ensureDebianKernel = async (): Promise<never> => noBuilder();
export const buildAgent = async (): Promise<never> => noBuilder();
