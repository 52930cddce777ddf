import { describe, expect, it } from 'vitest';
import { spawnSync } from 'node:child_process';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { parseGitConfig } from '../host-broker/src/router/git-config-parse.ts';

/**
 * The router's reader of git configuration against git itself: for each text, the entries
 * `git config --file X --list` prints, or git's refusal. A reader that saw fewer keys than
 * git (or other ones) would let a program-naming key through.
 */
const CASES: string[] = [
  '[core]\n\tbare = false\n\tfilemode = true\n',
  '[diff "pdf"]\n\ttextconv = ./t.sh\n',
  '[diff.Pdf]\n\ttextconv = x\n',
  '[diff "P\\"d\\\\f"]\n\tcommand = x\n',
  '\xef\xbb\xbf[core]\n\tfsmonitor = x\n',
  '[core]\r\n\tfsmonitor = x\r\n',
  '[core] fsmonitor = x\n',
  '[x "a"]y=1\n',
  '  [core]\n  k-1 = v\n',
  '[a]\n\tk = one \\\n  two\n',
  '[a]\n\tk = "with # and ; inside" # comment\n',
  '[a]\n\tk = v ; comment\n\tj\n',
  '[a]\n\tk =\n',
  '[a]\n\tk = "tab\\there" and\\nnewline\n',
  '[a]\n\tk = "spaces  kept"   and   collapsed  \n',
  '# only a comment\n; another\n',
  '[a.b "c"]\n\tk = v\n',
  '[a]\n\tK = v\n[A]\n\tk = w\n',
  // Refused by git:
  '[x\n',
  '[a]\n\tk v = c\n',
  '[x "a" ]\n\tk = v\n',
  '[a]\n\tk = "unterminated\n',
  '[a]\n\tk = \\q\n',
  '[a]\n\t1k = v\n',
  '[]\n\tk = v\n',
  '[x"a"]\n\tk = v\n',
  '[a]\n\tk\t= v\n\t=v\n',
  '[a "b\nc"]\n\tk = v\n',
];

function gitList(text: string): string[] | null {
  const file = join(mkdtempSync(join(tmpdir(), 'hutch-gitcfg-parse-')), 'config');
  writeFileSync(file, Buffer.from(text, 'latin1'));
  const r = spawnSync('git', ['config', '--file', file, '--list', '-z'], { encoding: 'latin1' });
  if (r.status !== 0) return null;
  return r.stdout.split('\0').filter(Boolean).map((e) => e.replace('\n', '='));
}

describe('git configuration reader', () => {
  it.each(CASES.map((c) => [JSON.stringify(c), c]))('reads %s as git does', (_, text) => {
    const ours = parseGitConfig(text);
    const git = gitList(text);
    if (git === null) {
      expect(ours.ok, `git refuses it; ours read ${JSON.stringify(ours)}`).toBe(false);
      return;
    }
    expect(ours.ok, JSON.stringify(ours)).toBe(true);
    if (!ours.ok) return;
    const listed = ours.entries.map((e) => `${e.section}.${e.sub === null ? '' : `${e.sub}.`}${e.key}${e.value === null ? '' : `=${e.value}`}`);
    expect(listed).toEqual(git);
  });
});
