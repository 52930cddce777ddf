/**
 * The repository stands alone: nothing the tests, the demo or the benches' defaults need
 * may live beside the clone (CI has a ../shared there; a new user's clone has nothing).
 *
 * - Every tracked file outside bench/ is scanned for a path that leaves the repository: a
 *   `../` path built from the file's own location (import.meta, __dirname, `here`, a
 *   Markdown link, or any path in a script or config file) that resolves outside it, or an
 *   absolute path into a directory beside the clone.
 * - The memory tests' workload set-up runs in a fresh clone with nothing beside it, against
 *   a real agent, as far as a host takes it: the projects and the server reach the agent's
 *   workspace (what follows, waiting for the guest's workload cgroup, needs a VM).
 */
import { execFileSync } from 'node:child_process';
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, symlinkSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join, relative, resolve } from 'node:path';
import { pathToFileURL } from 'node:url';
import { afterAll, describe, expect, it } from 'vitest';
import { startAgent } from './helpers/agent-process.ts';
import { waitFor } from './helpers/wait-for.ts';

const repo = resolve(import.meta.dirname, '..');
let parent: string | undefined;

afterAll(() => {
  if (parent) rmSync(parent, { recursive: true, force: true });
});

/** A `../` path: one or more `../` then a name (a bare `../`, as in "entries with `../`", names nothing). */
const CLIMB = /(?<![\w./-])((?:\.\.\/)+)([A-Za-z0-9_][\w.\-/]*)/g;
/** Lines whose `../` paths are relative to the file itself (code building a path from its own location, links). */
const FROM_ITSELF = /import\.meta|__dirname|__filename|\bhere\b|\]\(|href=|src=/;
/** Sources whose `../` strings are data (tenant paths in tests, say) unless built from the file's location. */
const CODE = /\.(ts|mts|js|mjs|cjs)$/;

interface OutsidePath {
  file: string;
  line: number;
  path: string;
}

/** Paths in `text` (the tracked file `file`) that leave `root`; `siblings` are the entries beside the clone. */
function pathsOutside(root: string, file: string, text: string, siblings: string[]): OutsidePath[] {
  const out: OutsidePath[] = [];
  const parentDir = dirname(root);
  const absolute = siblings.length ? new RegExp(`(?<![\\w.-])${escapeRe(parentDir === '/' ? '' : parentDir)}/(${siblings.map(escapeRe).join('|')})(?![\\w.-])`, 'g') : undefined;
  text.split('\n').forEach((line, i) => {
    if (!CODE.test(file) || FROM_ITSELF.test(line)) {
      // Scripts and config files run from the repository's root: their paths are relative to it too.
      const bases = CODE.test(file) || file.endsWith('.md') ? [dirname(file)] : [dirname(file), '.'];
      for (const m of line.matchAll(CLIMB)) {
        if (bases.some((b) => relative(root, resolve(root, b, `${m[1]}${m[2]}`)).startsWith('..'))) out.push({ file, line: i + 1, path: m[0] });
      }
    }
    if (absolute) for (const m of line.matchAll(absolute)) out.push({ file, line: i + 1, path: m[0] });
  });
  return out;
}

function escapeRe(s: string): string {
  return s.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
}

describe('the repository stands alone', () => {
  it('no tracked file outside bench/ names a path outside the repository', () => {
    const files = execFileSync('git', ['ls-files', '-z'], { cwd: repo, encoding: 'utf8' }).split('\0').filter((f) => f && !f.startsWith('bench/'));
    expect(files.length).toBeGreaterThan(100);
    const siblings = readdirSync(dirname(repo)).filter((n) => resolve(dirname(repo), n) !== repo);
    const found: OutsidePath[] = [];
    for (const f of files) {
      const p = join(repo, f);
      if (!existsSync(p)) continue; // deleted in the working tree
      const text = readFileSync(p);
      if (text.includes(0)) continue; // binary
      found.push(...pathsOutside(repo, f, text.toString('utf8'), siblings));
    }
    expect(found.map((o) => `${o.file}:${o.line}: ${o.path}`)).toEqual([]);
  });

  it('the scan finds such paths (the check above can fail)', () => {
    const root = '/srv/clones/hutch';
    const hits = (file: string, text: string) => pathsOutside(root, file, text, ['shared', 'other']).map((o) => o.path);
    // Built, not written out, so this file does not name them itself.
    const up = (n: number) => '../'.repeat(n);
    expect(hits('bench/lib/sessions.ts', `export const SHARED = resolve(here, '${up(3)}shared/bench');`)).toEqual([`${up(3)}shared/bench`]);
    expect(hits('test/x.test.ts', `const p = new URL('${up(2)}shared/bench/projects', import.meta.url);`)).toEqual([`${up(2)}shared/bench/projects`]);
    expect(hits('README.md', `the corpus in [shared](${up(1)}shared/bench) beside the clone`)).toEqual([`${up(1)}shared/bench`]);
    expect(hits('.ci/run', `cp -r ${up(1)}shared/bench bench/corpus`)).toEqual([`${up(1)}shared/bench`]);
    expect(hits('test/x.test.ts', `readFileSync('/srv/clones/${'shared'}/bench/projects/datespan')`)).toEqual(['/srv/clones/shared']);
    // Not outside: within the repository, a tenant's path in a test, a bare `../`, a guest path.
    expect(hits('host-broker/src/broker.ts', `new URL('${up(2)}package.json', import.meta.url)`)).toEqual([]);
    expect(hits('test/x.test.ts', `await sb.files.read('${up(2)}etc/passwd')`)).toEqual([]);
    expect(hits('README.md', 'tarball entries with `../` or absolute names')).toEqual([]);
    expect(hits('README.md', "await sbx.files.write('/work/hello.py', 'x')")).toEqual([]);
  });

  it("in a fresh clone with nothing beside it, the memory tests' workload set-up finds its projects", async () => {
    parent = mkdtempSync(join(tmpdir(), 'hutch-alone-'));
    const clone = join(parent, 'hutch');
    execFileSync('git', ['clone', '-q', '--no-hardlinks', repo, clone], { stdio: 'ignore' });
    expect(readdirSync(parent)).toEqual(['hutch']);
    // What `npm ci` would put there: inside the clone, not beside it.
    symlinkSync(join(repo, 'node_modules'), join(clone, 'node_modules'));
    const workloads = (await import(pathToFileURL(join(clone, 'bench/lib/memory-workloads.ts')).href)) as typeof import('../bench/lib/memory-workloads.ts');
    for (const w of [workloads.PYTHON_REPL, workloads.NODE_LSP]) {
      const agent = await startAgent();
      try {
        // startWorkload pushes the projects and the server, then waits (in a shell) for the
        // guest's workload cgroup, which a host never gives it: the pushed tree is the check.
        const failed = workloads.startWorkload(agent.client, w, 60_000).then(() => {
          throw new Error(`${w.name}: startWorkload returned on a host`);
        });
        failed.catch(() => undefined);
        const pushed = () => w.projects.every((p) => existsSync(join(agent.root, p))) && existsSync(join(agent.root, '.hutch-mem', w.file));
        await Promise.race([waitFor(async () => pushed(), 60_000, `${w.name}: projects and server in the workspace`), failed]);
        for (const p of w.projects) expect(readdirSync(join(agent.root, p)).length, `${w.name}: ${p}`).toBeGreaterThan(0);
      } finally {
        await agent.stop();
      }
    }
  }, 180_000);
});
