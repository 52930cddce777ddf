import { defineConfig } from 'vitest/config';

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
  },
});
