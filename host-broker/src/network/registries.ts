/**
 * The package registries this host is configured with (npm, pip, apt), read once at the
 * broker's start: the shipped egress default lets a sandbox's `npm install`, `pip install`
 * and `apt-get` reach exactly these, and tells the guest's tools to use the same ones (a
 * host behind a registry mirror gets its mirror in the sandbox too).
 *
 * Only files and environment variables are read (no `npm config` or `pip config` process):
 * the broker starts fast and a tool missing on the host is no error.
 */
import { readdirSync, readFileSync } from 'node:fs';
import { homedir } from 'node:os';
import { dirname, join } from 'node:path';

export interface HostRegistries {
  /** npm's registry URL (the default one unless configured). */
  npm: string;
  /** pip's index URL and extra index URLs. */
  pip: { index: string; extra: string[] };
  /** apt source URLs (the host's and the guest image's). */
  apt: string[];
  /** Egress allow rules reaching all of them: `host:port` of each URL. */
  rules: string[];
  /** Where each came from, for the broker's start log. */
  sources: string[];
}

const DEFAULT_NPM = 'https://registry.npmjs.org/';
const DEFAULT_PIP = 'https://pypi.org/simple';
/** Where pypi.org's index sends downloads. */
const PYPI_FILES = 'https://files.pythonhosted.org/';

function read(path: string): string | undefined {
  try {
    return readFileSync(path, 'utf8').slice(0, 1024 * 1024);
  } catch {
    return undefined;
  }
}

/** `key = value` lines of an ini-like file (npmrc, pip.conf), last one winning; sections ignored. */
function iniValues(text: string, key: string): string[] {
  const out: string[] = [];
  for (const line of text.split('\n')) {
    const m = /^\s*([^=#;\s]+)\s*=\s*(.*?)\s*$/.exec(line);
    if (m && m[1]!.toLowerCase() === key) out.push(...m[2]!.split(/\s+/).filter(Boolean));
  }
  return out;
}

function npmRegistry(env: NodeJS.ProcessEnv, home: string, sources: string[]): string {
  const fromEnv = env['npm_config_registry'] ?? env['NPM_CONFIG_REGISTRY'];
  if (fromEnv) {
    sources.push('npm: $npm_config_registry');
    return fromEnv;
  }
  // npm's own order, most specific last: builtin, global (<prefix>/etc/npmrc), user.
  const files = [join(dirname(process.execPath), '..', 'etc', 'npmrc'), '/etc/npmrc', join(home, '.npmrc')];
  let found: string | undefined;
  for (const f of files) {
    const text = read(f);
    const v = text === undefined ? undefined : iniValues(text, 'registry').at(-1);
    if (v) {
      found = v;
      sources.push(`npm: ${f}`);
    }
  }
  return found ?? DEFAULT_NPM;
}

function pipIndexes(env: NodeJS.ProcessEnv, home: string, sources: string[]): { index: string; extra: string[] } {
  let index: string | undefined = env['PIP_INDEX_URL'];
  let extra = (env['PIP_EXTRA_INDEX_URL'] ?? '').split(/\s+/).filter(Boolean);
  if (index) sources.push('pip: $PIP_INDEX_URL');
  const files = ['/etc/pip.conf', '/etc/xdg/pip/pip.conf', join(home, '.pip', 'pip.conf'), join(home, '.config', 'pip', 'pip.conf')];
  for (const f of files) {
    const text = read(f);
    if (text === undefined) continue;
    const i = iniValues(text, 'index-url').at(-1);
    const e = iniValues(text, 'extra-index-url');
    if (i && !env['PIP_INDEX_URL']) index = i;
    if (e.length && !env['PIP_EXTRA_INDEX_URL']) extra = e;
    if (i || e.length) sources.push(`pip: ${f}`);
  }
  return { index: index ?? DEFAULT_PIP, extra };
}

/** URLs of `deb` lines (one-line format) and `URIs:` fields (deb822 .sources). */
export function aptUrls(text: string): string[] {
  const out: string[] = [];
  for (const line of text.split('\n')) {
    const deb = /^\s*deb(?:-src)?\s+(?:\[[^\]]*\]\s+)?(\S+)/.exec(line);
    if (deb) out.push(deb[1]!);
    const uris = /^\s*URIs:\s*(.+)$/i.exec(line);
    if (uris) out.push(...uris[1]!.split(/\s+/).filter(Boolean));
  }
  return out.filter((u) => /^https?:\/\//i.test(u));
}

function aptSources(root: string, sources: string[]): string[] {
  const files = [join(root, 'sources.list')];
  try {
    for (const f of readdirSync(join(root, 'sources.list.d'))) if (/\.(list|sources)$/.test(f)) files.push(join(root, 'sources.list.d', f));
  } catch {
    // no sources.list.d: only the main file
  }
  const out: string[] = [];
  for (const f of files) {
    const text = read(f);
    if (text === undefined) continue;
    const urls = aptUrls(text);
    if (urls.length) sources.push(`apt: ${f}`);
    out.push(...urls);
  }
  return out;
}

/** `host:port` of a URL (its explicit port, else the scheme's), or undefined for a malformed one. */
export function ruleForUrl(url: string): string | undefined {
  try {
    const u = new URL(url);
    if (u.protocol !== 'http:' && u.protocol !== 'https:') return undefined;
    const port = u.port || (u.protocol === 'https:' ? '443' : '80');
    const host = u.hostname.startsWith('[') ? u.hostname : u.hostname;
    return `${host}:${port}`;
  } catch {
    return undefined;
  }
}

export interface RegistryOptions {
  env?: NodeJS.ProcessEnv;
  home?: string;
  aptRoot?: string;
  /** Apt sources the guest image itself uses (rootfs/packages.ts): its apt-get needs them whatever the host has. */
  guestApt?: readonly string[];
}

export function hostRegistries(o: RegistryOptions = {}): HostRegistries {
  const env = o.env ?? process.env;
  const home = o.home ?? homedir();
  const sources: string[] = [];
  const npm = npmRegistry(env, home, sources);
  const pip = pipIndexes(env, home, sources);
  const apt = [...new Set([...aptSources(o.aptRoot ?? '/etc/apt', sources), ...(o.guestApt ?? [])])];
  const urls = [npm, pip.index, ...pip.extra, ...apt];
  // pypi.org's index links to its file host; a mirror serves its own files.
  if (new URL(pip.index, 'https://x').hostname === 'pypi.org') urls.push(PYPI_FILES);
  const rules = [...new Set(urls.map(ruleForUrl).filter((r): r is string => r !== undefined))];
  return { npm, pip, apt, rules, sources };
}
