import { build } from 'esbuild';
import { createHash } from 'node:crypto';
import { mkdirSync, writeFileSync } from 'node:fs';
import { dirname, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

/**
 * Bundles the agent into one plain-JS file: what the rootfs bakes in (no TypeScript
 * toolchain in the guest) and what tests and the local backend run. Targets Node 18, the
 * nodejs of Debian bookworm's guest image.
 */
const here = dirname(fileURLToPath(import.meta.url));
export const AGENT_ENTRY = resolve(here, 'src/main.ts');
export const AGENT_BUNDLE = resolve(here, '../dist/hutch-agent.mjs');

export async function buildAgent(outfile = AGENT_BUNDLE): Promise<{ path: string; sha256: string; bytes: number }> {
  mkdirSync(dirname(outfile), { recursive: true });
  const r = await build({
    entryPoints: [AGENT_ENTRY],
    outfile,
    bundle: true,
    platform: 'node',
    target: 'node18',
    format: 'esm',
    // msgpackr's optional native accelerator cannot live in a read-only, toolchain-free guest.
    external: ['msgpackr-extract'],
    banner: { js: "import { createRequire as __hutchCreateRequire } from 'node:module'; const require = __hutchCreateRequire(import.meta.url);" },
    legalComments: 'none',
    logLevel: 'warning',
    write: false,
  });
  const out = r.outputFiles[0];
  if (!out) throw new Error('esbuild produced no output');
  writeFileSync(outfile, out.contents, { mode: 0o755 });
  const sha256 = createHash('sha256').update(out.contents).digest('hex');
  return { path: outfile, sha256, bytes: out.contents.length };
}

if (process.argv[1] && resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  const outIdx = process.argv.indexOf('--out');
  const res = await buildAgent(outIdx > 0 ? resolve(process.argv[outIdx + 1] as string) : AGENT_BUNDLE);
  process.stdout.write(JSON.stringify(res) + '\n');
}
