/**
 * Builds the npm package's dist/ (run by `npm pack` through `prepack`):
 *
 *   dist/index.js        the SDK (`import { Hutch } from 'hutch'`), plain ESM for Node 20
 *   dist/types/...       its .d.ts files (tsc --emitDeclarationOnly, tsconfig.build.json)
 *   dist/cli.js          the `hutch` CLI (broker), without the guest image builders
 *   dist/spawn-helper-main.js  the fast path's spawn helper process
 *
 * Dependencies stay imports of the package's `dependencies`; only our code is bundled.
 */
import { execFileSync } from 'node:child_process';
import { chmodSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { build, type Plugin } from 'esbuild';

const root = resolve(dirname(fileURLToPath(import.meta.url)), '../..');
const dist = join(root, 'dist');
const STUBS = join(root, 'build/package/builder-stubs.ts');
/** Modules that build the guest image (or the agent from source): not in the package. */
const BUILDERS = ['rootfs/build.ts', 'rootfs/image.ts', 'kernel-configs/build.ts', 'kernel-configs/debian-kernel.ts', 'guest-agent/build.ts', 'host-broker/src/templates/debootstrap.ts'].map((p) => join(root, p));

const stubBuilders: Plugin = {
  name: 'hutch-stub-builders',
  setup(b) {
    b.onResolve({ filter: /\.ts$/ }, (args) => {
      const target = resolve(args.resolveDir, args.path);
      return BUILDERS.includes(target) ? { path: STUBS } : undefined;
    });
  },
};

/**
 * Sources find the repo's package.json by a path relative to themselves (the broker's
 * version); in the package that file is one level above dist/, next to the bundle.
 */
const packageJsonNextToDist: Plugin = {
  name: 'hutch-package-json',
  setup(b) {
    b.onLoad({ filter: /\.ts$/ }, (args) => {
      const text = readFileSync(args.path, 'utf8');
      const re = /new URL\((['"])((?:\.\.\/)+)package\.json\1, import\.meta\.url\)/g;
      if (!re.test(text)) return undefined;
      const fixed = text.replace(re, (m, _q: string, rel: string) => (resolve(dirname(args.path), rel, 'package.json') === join(root, 'package.json') ? "new URL('../package.json', import.meta.url)" : m));
      return { contents: fixed, loader: 'ts' };
    });
  },
};

const common = {
  bundle: true,
  platform: 'node',
  target: 'node20',
  format: 'esm',
  packages: 'external',
  legalComments: 'none',
  logLevel: 'warning',
} as const;

rmSync(join(dist, 'index.js'), { force: true });
rmSync(join(dist, 'cli.js'), { force: true });
rmSync(join(dist, 'spawn-helper-main.js'), { force: true });
rmSync(join(dist, 'types'), { recursive: true, force: true });

await build({ ...common, entryPoints: [join(root, 'host-broker/src/sdk/index.ts')], outfile: join(dist, 'index.js'), plugins: [packageJsonNextToDist] });
await build({
  ...common,
  entryPoints: [join(root, 'host-broker/src/cli.ts')],
  outfile: join(dist, 'cli.js'),
  plugins: [stubBuilders, packageJsonNextToDist],
  // cli.ts starts with its own #! line, which esbuild keeps first.
  banner: { js: "import { createRequire as __hutchCreateRequire } from 'node:module'; const require = __hutchCreateRequire(import.meta.url);" },
});
chmodSync(join(dist, 'cli.js'), 0o755);
// The fast path's spawn helper is a process of its own (forked by the broker).
await build({ ...common, entryPoints: [join(root, 'host-broker/src/fastpath/spawn-helper-main.ts')], outfile: join(dist, 'spawn-helper-main.js') });

try {
  execFileSync(process.execPath, [join(root, 'node_modules/typescript/bin/tsc'), '-p', join(root, 'tsconfig.build.json')], { stdio: ['ignore', 'pipe', 'pipe'], encoding: 'utf8' });
} catch (err) {
  // tsc reports on stdout; `npm pack --json` owns ours, so the errors go to stderr.
  const e = err as { stdout?: string; stderr?: string };
  process.stderr.write(`hutch: declarations failed (tsc -p tsconfig.build.json):\n${e.stdout ?? ''}${e.stderr ?? ''}\n`);
  process.exit(1);
}
// tsc keeps the sources' `.ts` specifiers in declarations; the package ships `.d.ts`
// files, which a consumer's TypeScript finds through `.js` specifiers.
for (const f of walk(join(dist, 'types'))) {
  if (!f.endsWith('.d.ts')) continue;
  const text = readFileSync(f, 'utf8');
  writeFileSync(f, text.replace(/(from\s+['"]\.{1,2}\/[^'"]*?)\.ts(['"])/g, '$1.js$2').replace(/(import\(['"]\.{1,2}\/[^'"]*?)\.ts(['"]\))/g, '$1.js$2'));
}
process.stderr.write(`hutch: package built in ${dist} (index.js, types/, cli.js, spawn-helper-main.js)\n`);

function* walk(dir: string): Generator<string> {
  for (const name of readdirSync(dir)) {
    const p = join(dir, name);
    if (statSync(p).isDirectory()) yield* walk(p);
    else yield p;
  }
}
