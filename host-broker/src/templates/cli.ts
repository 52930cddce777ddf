/** `hutch template build | ls | inspect | rm | prune` (dispatched from cli.ts): options checked before the builder loads. */
import { callerPath, Command, int, oneOf, UsageError, writableDir, type OptionSpec } from '../../../guest-agent/src/cli-options.ts';
import { installPackagesForClone } from '../cli/host-packages.ts';
import { parseCidr } from './egress-proxy.ts';
import { defaultDataDir, DEFAULT_TEMPLATE, TemplateStore, validateTemplateName } from './store.ts';

const DATA_DIR = {
  'data-dir': { arg: 'D', help: "the broker's data dir (as for hutch serve: env HUTCH_DATA, else ~/.local/state/hutch)", parse: writableDir },
} satisfies Record<string, OptionSpec>;

function envPair(text: string, option: string): [string, string] {
  const i = text.indexOf('=');
  if (i <= 0) throw new UsageError(`${option} expects KEY=VALUE, got ${JSON.stringify(text)}`, option);
  return [text.slice(0, i), text.slice(i + 1)];
}

const BUILD = new Command({
  name: 'hutch template build',
  usage: 'NAME --from SOURCE [options]',
  summary:
    'Build a template: a root filesystem with the agent brought in, and its pristine snapshot. SOURCE: a rootfs tarball\n(docker/podman export; plain or gzip), a directory, an OCI image layout directory, or debootstrap:SUITE.\nThe root must provide /bin/sh, bash and glibc; hutch brings its own agent, Node and init.',
  positionals: { min: 1, max: 1 },
  options: {
    from: { arg: 'SOURCE', help: 'where the root filesystem comes from (required)' },
    packages: { arg: 'a,b,c', help: 'Debian packages for debootstrap:SUITE', parse: (t: string) => t.split(',').map((s) => s.trim()).filter(Boolean) },
    run: { arg: "'STEP'", help: "a shell step run as root in a microVM booted from the image (repeatable, in order);\nnetwork only through hutch's egress proxy (http_proxy/https_proxy)", multiple: true },
    'egress-allow': { arg: 'CIDR', help: 'a private range the steps may reach, such as a LAN mirror (repeatable)', multiple: true, parse: (t: string) => (parseCidr(t), t) },
    offline: { help: 'give the --run steps no network at all' },
    env: { arg: 'K=V', help: 'environment for the steps, the start command and every tenant command (repeatable)', multiple: true, parse: envPair },
    workdir: { arg: 'DIR', help: 'where the steps and the start command run (default /)' },
    start: { arg: "'CMD'", help: 'run at boot before the pristine snapshot is taken: warm what users will run' },
    memory: { arg: 'MIB', help: 'build VM and pristine snapshot memory (default 512)', parse: int(64, 65536) },
    cpus: { arg: 'N', help: 'vCPUs (default 1)', parse: int(1, 64) },
    kernel: { arg: 'K', help: 'hutch | debian (default hutch)', parse: oneOf(['hutch', 'debian'] as const) },
    force: { help: 'rebuild even when the inputs are unchanged' },
    json: { help: 'print the result as one JSON line' },
    ...DATA_DIR,
  },
});

const LS = new Command({ name: 'hutch template ls', summary: 'List the templates in the data dir.', options: { json: { help: 'one JSON array' }, ...DATA_DIR } });
const INSPECT = new Command({ name: 'hutch template inspect', usage: 'NAME [options]', summary: "Print a template's manifest.", positionals: { min: 1, max: 1 }, options: DATA_DIR });
const RM = new Command({ name: 'hutch template rm', usage: 'NAME [options]', summary: 'Remove a template name (and its build, when no other name points at it).', positionals: { min: 1, max: 1 }, options: DATA_DIR });
const PRUNE = new Command({ name: 'hutch template prune', summary: 'Remove builds no name points at (left by rebuilds with other inputs).', options: DATA_DIR });

const SUBCOMMANDS = { build: BUILD, ls: LS, inspect: INSPECT, rm: RM, prune: PRUNE } as const;

export const TEMPLATE_HELP = `usage: hutch template <command> [options]

Templates: root filesystems a session's VM boots (README "Templates"); the same --data-dir as hutch serve.

commands:
${Object.entries(SUBCOMMANDS)
  .map(([n, c]) => `  ${n.padEnd(9)}${c.spec.summary.split('\n')[0]?.replace(/\. .*$/, '.')}`)
  .join('\n')}

hutch template <command> --help says more.
`;

function fmtMiB(bytes: number): string {
  return `${(bytes / 1024 / 1024).toFixed(0)} MiB`;
}

function storeOf(dataDir: string | undefined): { dataDir: string; store: TemplateStore } {
  const dir = dataDir ?? writableDir(defaultDataDir(), '--data-dir (from HUTCH_DATA or the default)');
  return { dataDir: dir, store: new TemplateStore(dir) };
}

function templateName(name: string | undefined): string {
  try {
    return validateTemplateName(name);
  } catch (err) {
    throw new UsageError((err as Error).message);
  }
}

export async function templateMain(args: string[]): Promise<void> {
  const [sub, ...rest] = args;
  if (!sub || sub === '-h' || sub === '--help' || sub === 'help') {
    process.stdout.write(TEMPLATE_HELP);
    return;
  }
  if (!Object.hasOwn(SUBCOMMANDS, sub)) throw new UsageError(`hutch template: unknown command ${sub}; one of ${Object.keys(SUBCOMMANDS).join(', ')} (see hutch template --help)`);
  switch (sub as keyof typeof SUBCOMMANDS) {
    case 'build': {
      const p = BUILD.parse(rest);
      if (!p) return;
      const v = p.values;
      const name = templateName(p.positionals[0]);
      if (!v.from) throw new UsageError('hutch template build NAME --from SOURCE: --from is required (see hutch template build --help)', '--from');
      const { dataDir } = storeOf(v['data-dir']);
      await installPackagesForClone();
      const [{ buildTemplate }, { cacheDir }] = await Promise.all([import('./build.ts'), import('../backends/registry.ts')]);
      const r = await buildTemplate({
        name,
        from: v.from.startsWith('debootstrap:') ? v.from : callerPath(v.from),
        ...(v.packages ? { packages: v.packages } : {}),
        run: v.run,
        env: Object.fromEntries(v.env),
        ...(v.workdir ? { workdir: v.workdir } : {}),
        ...(v.start !== undefined ? { start: v.start } : {}),
        ...(v.memory !== undefined ? { memoryMiB: v.memory } : {}),
        ...(v.cpus !== undefined ? { cpus: v.cpus } : {}),
        ...(v.kernel ? { kernel: v.kernel } : {}),
        force: v.force,
        ...(v.offline ? { network: false } : {}),
        ...(v['egress-allow'].length ? { egressAllow: v['egress-allow'] } : {}),
        dataDir,
        cacheDir: cacheDir(),
        log: (l) => process.stderr.write(`template: ${l}\n`),
      });
      const line = { name, id: r.manifest.id, cached: r.cached, seconds: Math.round(r.seconds * 10) / 10, dir: r.dir, snapshot: r.snapshot };
      process.stdout.write(v.json ? `${JSON.stringify(line)}\n` : `template ${name} ${r.cached ? 'reused' : 'built'}: ${r.manifest.id} in ${line.seconds} s (${r.dir}); pristine snapshot ${fmtMiB(r.snapshot.bytes)} on disk\n`);
      return;
    }
    case 'ls': {
      const p = LS.parse(rest);
      if (!p) return;
      const list = storeOf(p.values['data-dir']).store.list();
      if (p.values.json) {
        process.stdout.write(`${JSON.stringify(list.map((e) => ({ name: e.name, id: e.manifest.id, source: e.manifest.source, builtAt: e.manifest.builtAt })))}\n`);
        return;
      }
      process.stdout.write(`${DEFAULT_TEMPLATE}\t(built in: hutch's Debian bookworm image, ./hutch setup)\n`);
      for (const e of list) process.stdout.write(`${e.name}\t${e.manifest.id}\t${e.manifest.source.kind} ${e.manifest.source.ref}\t${fmtMiB(e.manifest.rootfsAllocatedBytes)}\t${e.manifest.builtAt}\n`);
      return;
    }
    case 'inspect': {
      const p = INSPECT.parse(rest);
      if (!p) return;
      const e = storeOf(p.values['data-dir']).store.resolve(templateName(p.positionals[0]));
      process.stdout.write(`${JSON.stringify({ ...e.manifest, dir: e.dir, allocatedBytes: TemplateStore.allocatedBytes(e.dir) }, null, 2)}\n`);
      return;
    }
    case 'prune': {
      const p = PRUNE.parse(rest);
      if (!p) return;
      const gone = storeOf(p.values['data-dir']).store.removeUnnamed();
      process.stdout.write(`removed ${gone.length} build(s) no name points at${gone.length ? `: ${gone.join(' ')}` : ''}\n`);
      return;
    }
    case 'rm': {
      const p = RM.parse(rest);
      if (!p) return;
      const name = templateName(p.positionals[0]);
      if (name === DEFAULT_TEMPLATE) throw new UsageError('the default template is not removable');
      const r = storeOf(p.values['data-dir']).store.remove(name);
      process.stdout.write(`removed ${name}${r.removedBuild ? ' and its build' : ' (its build is still named otherwise)'}\n`);
      return;
    }
  }
}
