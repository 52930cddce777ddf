import { configDefaults, defineConfig } from 'vitest/config';
import { SkipSummary } from './test/helpers/skip-summary.ts';
import { scaleSkipReason, vmSkipReason } from './test/helpers/tiers.ts';

// The microVM tier runs wherever it can; where it cannot (or with HUTCH_SKIP_GUEST=1, the
// host-only tier) its tests are skipped, and the summary says how many and why.
const noVm = vmSkipReason();
const noScale = scaleSkipReason();

/**
 * Run alone, after everything else: the vsock channel goes through vhost-device-vsock (a
 * third-party backend, Debian sid's 0.3.0), whose data path stalled under a saturated
 * two-core host (a 4 MiB echo that takes 1.5 s alone never finished beside a template
 * build). hutch's own VMs do not use it; its test says what it can do on a quiet host.
 */
const ALONE = ['test/vsock.test.ts'];

export default defineConfig({
  test: {
    globalSetup: ['test/helpers/global-setup.ts'],
    pool: 'forks',
    testTimeout: 60_000,
    hookTimeout: 120_000,
    tags: [
      { name: 'vm', description: 'boots QEMU microVMs from the guest image (minutes under TCG)', skip: noVm !== undefined },
      { name: 'scale', description: 'moves 100,000 files through the sync (minutes on two cores)', skip: noScale !== undefined },
    ],
    reporters: ['default', new SkipSummary(noVm, noScale)],
    projects: [
      // Two cores: VM tests and process-heavy tests contend; a bounded worker count keeps
      // timeouts meaningful without serialising everything.
      { extends: true, test: { name: 'suite', include: ['test/**/*.test.ts'], exclude: [...configDefaults.exclude, ...ALONE], maxWorkers: 2, sequence: { groupOrder: 0 } } },
      { extends: true, test: { name: 'alone', include: ALONE, maxWorkers: 1, sequence: { groupOrder: 1 } } },
    ],
  },
});
