import { defineConfig } from 'vitest/config';
import { SkipSummary } from './test/helpers/skip-summary.ts';
import { scaleSkipReason, vmSkipReason } from './test/helpers/tiers.ts';

// The microVM tier runs wherever it can; where it cannot (or with HUTCH_SKIP_GUEST=1, the
// host-only tier) its tests are skipped, and the summary says how many and why.
const noVm = vmSkipReason();
const noScale = scaleSkipReason();

export default defineConfig({
  test: {
    include: ['test/**/*.test.ts'],
    globalSetup: ['test/helpers/global-setup.ts'],
    pool: 'forks',
    testTimeout: 60_000,
    hookTimeout: 120_000,
    // Two cores: VM tests and process-heavy tests contend; a bounded worker count keeps
    // timeouts meaningful without serialising everything.
    maxWorkers: 2,
    tags: [
      { name: 'vm', description: 'boots QEMU microVMs from the guest image (minutes under TCG)', skip: noVm !== undefined },
      { name: 'scale', description: 'moves 100,000 files through the sync (minutes on two cores)', skip: noScale !== undefined },
    ],
    reporters: ['default', new SkipSummary(noVm, noScale)],
  },
});
