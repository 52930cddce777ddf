/**
 * Every bash call of the repo's recorded sessions (examples/sessions), routed with the
 * real parser and the real host probe, against the classification in
 * examples/sessions/README.md: heavy calls and plain shell outside the workspace must go
 * to the VM, with no exception; file-level bash calls should reach the fast path.
 */
import { beforeAll, describe, expect, it } from 'vitest';
import { initRouter, routeCommand } from '../host-broker/src/router/index.ts';
import { loadSessions as loadRecorded } from '../bench/lib/sessions.ts';

interface Call {
  session: string;
  /** 1-based, as the README numbers calls. */
  n: number;
  tool: string;
  command: string;
}

function loadSessions(): Map<string, Call[]> {
  const out = new Map<string, Call[]>();
  for (const s of loadRecorded()) {
    out.set(
      s.id,
      s.calls.map((c, i) => ({ session: s.id, n: i + 1, tool: c.tool, command: typeof c.args['command'] === 'string' ? c.args['command'] : '' })),
    );
  }
  return out;
}

/** README: calls that change HOME, and what they change. */
const CHANGES_HOME = new Map<string, string[]>([
  ['inv-add-cli-flag-commit#7', ['.gitconfig']],
  ['slug-fix-dashes#7', ['.cache/slugkit/last.txt']],
]);
/** README "outside the workspace": the `git config --global` call. */
const OUTSIDE = new Set(['inv-add-cli-flag-commit#7']);

/**
 * The README's rule, applied to the text as the README states it: heavy when any segment
 * of the list or pipeline starts with python3, node, make, bash <script> or git commit,
 * after skipping a leading `time`. (Splitting inside quotes only adds segments, and none of
 * those start with a heavy word, so the rule stays exact for this set.)
 */
function readmeClass(c: Call): 'heavy' | 'outside' | 'file' {
  if (OUTSIDE.has(`${c.session}#${c.n}`)) return 'outside';
  const segments = c.command.split(/&&|\|\||;|\|/).map((s) => s.trim().replace(/^time\s+/, ''));
  const heavy = segments.some((s) => /^(python3|node|make)(\s|$)/.test(s) || /^bash\s+\S/.test(s) || /^git\s+commit(\s|$)/.test(s));
  return heavy ? 'heavy' : 'file';
}

const sessions = loadSessions();
const all = [...sessions.values()].flat();
const bash = all.filter((c) => c.tool === 'bash');

beforeAll(async () => {
  await initRouter();
});

describe('recorded sessions', () => {
  it('reproduces the README call mix', () => {
    expect(sessions.size).toBe(3);
    expect(all.length).toBe(27);
    expect(bash.length).toBe(15);
    const classes = bash.map(readmeClass);
    expect(classes.filter((k) => k === 'heavy').length).toBe(8);
    expect(classes.filter((k) => k === 'outside').length).toBe(1);
    expect(classes.filter((k) => k === 'file').length).toBe(6);
  });

  it('sends every heavy call and every call outside the workspace to the VM', () => {
    const wrong = bash
      .filter((c) => readmeClass(c) !== 'file')
      .map((c) => ({ c, d: routeCommand(c.command) }))
      .filter(({ d }) => d.route !== 'vm')
      .map(({ c, d }) => `${c.session}#${c.n}: ${c.command} -> ${d.reason}`);
    expect(wrong).toEqual([]);
  });

  it('routes all 6 file-level bash calls to the fast path', () => {
    const file = bash.filter((c) => readmeClass(c) === 'file');
    const missed = file
      .map((c) => ({ c, d: routeCommand(c.command) }))
      .filter(({ d }) => d.route !== 'fastpath')
      .map(({ c, d }) => `${c.session}#${c.n}: ${c.command} -> ${d.reason}`);
    expect(missed).toEqual([]);
    const onFastPath = file.length - missed.length;
    expect(onFastPath).toBe(6);
  });

  /** Replays each session in order, telling the router what HOME changes the VM has seen. */
  function replay(report: (changed: string[]) => boolean | string[]): { fast: number; exceptions: string[] } {
    const exceptions: string[] = [];
    let fast = 0;
    for (const calls of sessions.values()) {
      const changed: string[] = [];
      for (const c of calls) {
        if (c.tool !== 'bash') continue;
        const d = routeCommand(c.command, { homeChanged: report(changed) });
        if (readmeClass(c) === 'file') {
          if (d.route === 'fastpath') fast++;
          else exceptions.push(`${c.session}#${c.n} ${d.code}`);
        } else expect(d.route).toBe('vm');
        changed.push(...(CHANGES_HOME.get(`${c.session}#${c.n}`) ?? []));
      }
    }
    return { fast, exceptions };
  }

  it('replayed in order, sends git to the VM once ~/.gitconfig changed there', () => {
    // The broker learns from the guest which HOME files changed; here the README says.
    const { fast, exceptions } = replay((changed) => [...changed]);
    // git after `git config --global ...`: ~/.gitconfig (identity) now exists only in the
    // VM and can change what git prints or whether it runs at all. A file under ~/.cache
    // does not concern git, so slug-fix-dashes#8 (`git diff`) stays on the fast path.
    expect(exceptions).toEqual(['inv-add-cli-flag-commit#9 home']);
    expect(fast).toBe(5);
  });

  it('replayed in order, sends git to the VM after any HOME change when the broker cannot say what changed', () => {
    const { fast, exceptions } = replay((changed) => changed.length > 0);
    expect(exceptions).toEqual(['inv-add-cli-flag-commit#9 home', 'slug-fix-dashes#8 home']);
    expect(fast).toBe(4);
  });

  it('explains every decision in one short sentence', () => {
    for (const c of bash) {
      const d = routeCommand(c.command);
      expect(d.reason).toMatch(/\S/);
      expect(d.reason).not.toContain('\n');
      if (d.route === 'vm') expect(['not_allowed', 'construct', 'expansion', 'option', 'path', 'tmp', 'environment']).toContain(d.code);
    }
  });
});
