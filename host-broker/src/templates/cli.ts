/** `hutch template build | ls | rm | inspect` (dispatched from cli.ts). */
import { parseArgs } from 'node:util';
import { resolve } from 'node:path';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { cacheDir } from '../backends/registry.ts';
import { buildTemplate } from './build.ts';
import { defaultDataDir, TemplateStore, validateTemplateName, DEFAULT_TEMPLATE } from './store.ts';

export const TEMPLATE_HELP = `usage:
  hutch template build NAME --from SOURCE [options]
  hutch template ls [--json]
  hutch template inspect NAME
  hutch template rm NAME
  hutch template prune      remove builds no name points at (left by rebuilds with other inputs)

SOURCE: a root filesystem tarball (docker/podman export; plain or gzip), a directory, an OCI
image layout directory, or debootstrap:SUITE (Debian, with --packages). The root must provide
/bin/sh, bash and glibc (/lib64/ld-linux-x86-64.so.2); hutch brings its own agent, Node, init.

build options:
  --packages a,b,c  Debian packages for debootstrap:SUITE
  --run 'STEP'      a shell step run as root inside a microVM booted from the image being built
                    (repeatable, in order). Steps reach the network through hutch's egress proxy
                    (http_proxy/https_proxy are set: apt-get, pip, curl, wget, git work; no DNS or
                    raw sockets, and never this host's loopback, own addresses or link-local/metadata;
                    private networks only with --egress-allow)
  --egress-allow CIDR  a private range the steps may reach, such as a LAN mirror (repeatable;
                    10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16, 100.64.0.0/10, fc00::/7 are closed)
  --offline         give the --run steps no network at all
  --env K=V         environment for the steps, the start command and every tenant command (repeatable)
  --workdir DIR     where the steps and the start command run (default /)
  --start 'CMD'     run at boot before the pristine snapshot is taken: warm what users will run
  --memory MIB      build VM and pristine snapshot memory (default 512)
  --cpus N          vCPUs (default 1)
  --kernel K        hutch | debian (default hutch)
  --force           rebuild even when the inputs are unchanged

common options:
  --data-dir D      the broker's data dir (same default as hutch serve: env HUTCH_DATA, else
                    ~/.local/state/hutch); a running broker sees templates built into it
`;

function parseEnvFlags(pairs: string[]): Record<string, string> {
  const env: Record<string, string> = {};
  for (const p of pairs) {
    const i = p.indexOf('=');
    if (i <= 0) throw new HutchError('bad_request', `--env expects KEY=VALUE, got ${JSON.stringify(p)}`);
    env[p.slice(0, i)] = p.slice(i + 1);
  }
  return env;
}

function fmtMiB(bytes: number): string {
  return `${(bytes / 1024 / 1024).toFixed(0)} MiB`;
}

export async function templateMain(args: string[]): Promise<void> {
  const [sub, ...rest] = args;
  if (!sub || sub === '-h' || sub === '--help' || sub === 'help') {
    process.stdout.write(TEMPLATE_HELP);
    return;
  }
  const { values, positionals } = parseArgs({
    args: rest,
    allowPositionals: true,
    options: {
      from: { type: 'string' },
      packages: { type: 'string' },
      run: { type: 'string', multiple: true },
      env: { type: 'string', multiple: true },
      workdir: { type: 'string' },
      start: { type: 'string' },
      memory: { type: 'string' },
      cpus: { type: 'string' },
      kernel: { type: 'string' },
      force: { type: 'boolean', default: false },
      offline: { type: 'boolean', default: false },
      'egress-allow': { type: 'string', multiple: true },
      json: { type: 'boolean', default: false },
      'data-dir': { type: 'string' },
    },
  });
  // ./hutch runs from the repo: relative paths are resolved where the user typed them.
  const callerCwd = process.env['HUTCH_CALLER_CWD'] ?? process.cwd();
  const dataDir = defaultDataDir(values['data-dir']);
  const store = new TemplateStore(dataDir);
  const name = positionals[0];
  switch (sub) {
    case 'build': {
      if (!name || !values.from) throw new HutchError('bad_request', `hutch template build NAME --from SOURCE\n${TEMPLATE_HELP}`);
      const kernel = values.kernel;
      if (kernel !== undefined && kernel !== 'hutch' && kernel !== 'debian') throw new HutchError('bad_request', `--kernel ${kernel}: hutch or debian`);
      const r = await buildTemplate({
        name,
        from: values.from.startsWith('debootstrap:') ? values.from : resolve(callerCwd, values.from),
        ...(values.packages ? { packages: values.packages.split(',').map((s) => s.trim()).filter(Boolean) } : {}),
        run: values.run ?? [],
        env: parseEnvFlags(values.env ?? []),
        ...(values.workdir ? { workdir: values.workdir } : {}),
        ...(values.start !== undefined ? { start: values.start } : {}),
        ...(values.memory ? { memoryMiB: Number(values.memory) } : {}),
        ...(values.cpus ? { cpus: Number(values.cpus) } : {}),
        ...(kernel ? { kernel } : {}),
        force: values.force,
        ...(values.offline ? { network: false } : {}),
        ...(values['egress-allow'] ? { egressAllow: values['egress-allow'] } : {}),
        dataDir,
        cacheDir: cacheDir(),
        log: (l) => process.stderr.write(`template: ${l}\n`),
      });
      const line = { name, id: r.manifest.id, cached: r.cached, seconds: Math.round(r.seconds * 10) / 10, dir: r.dir, snapshot: r.snapshot };
      process.stdout.write(values.json ? `${JSON.stringify(line)}\n` : `template ${name} ${r.cached ? 'reused' : 'built'}: ${r.manifest.id} in ${line.seconds} s (${r.dir}); pristine snapshot ${fmtMiB(r.snapshot.bytes)} on disk\n`);
      return;
    }
    case 'ls': {
      const list = store.list();
      if (values.json) {
        process.stdout.write(`${JSON.stringify(list.map((e) => ({ name: e.name, id: e.manifest.id, source: e.manifest.source, builtAt: e.manifest.builtAt })))}\n`);
        return;
      }
      process.stdout.write(`${DEFAULT_TEMPLATE}\t(built in: hutch's Debian bookworm image, ./hutch setup)\n`);
      for (const e of list) process.stdout.write(`${e.name}\t${e.manifest.id}\t${e.manifest.source.kind} ${e.manifest.source.ref}\t${fmtMiB(e.manifest.rootfsAllocatedBytes)}\t${e.manifest.builtAt}\n`);
      return;
    }
    case 'inspect': {
      if (!name) throw new HutchError('bad_request', 'hutch template inspect NAME');
      const e = store.resolve(validateTemplateName(name));
      process.stdout.write(`${JSON.stringify({ ...e.manifest, dir: e.dir, allocatedBytes: TemplateStore.allocatedBytes(e.dir) }, null, 2)}\n`);
      return;
    }
    case 'prune': {
      const gone = store.removeUnnamed();
      process.stdout.write(`removed ${gone.length} build(s) no name points at${gone.length ? `: ${gone.join(' ')}` : ''}\n`);
      return;
    }
    case 'rm': {
      if (!name) throw new HutchError('bad_request', 'hutch template rm NAME');
      if (name === DEFAULT_TEMPLATE) throw new HutchError('bad_request', 'the default template is not removable');
      const r = store.remove(validateTemplateName(name));
      process.stdout.write(`removed ${name}${r.removedBuild ? ' and its build' : ' (its build is still named otherwise)'}\n`);
      return;
    }
    default:
      throw new HutchError('bad_request', `unknown template command ${sub}\n${TEMPLATE_HELP}`);
  }
}
