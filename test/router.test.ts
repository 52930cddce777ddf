import { mkdirSync, mkdtempSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
import { FASTPATH_BINARIES, hostBinaryReport, initRouter, MAX_ROUTED_LENGTH, routeCommand, type RouteDecision } from '../host-broker/src/router/index.ts';
import { expandWord } from '../host-broker/src/router/words.ts';
import { sandboxCanRun } from '../host-broker/src/router/host.ts';
import { analyseSed } from '../host-broker/src/router/sed.ts';
import { MAX_SYNTAX_NODES, parseScript } from '../host-broker/src/router/parser.ts';

/** Table tests must not depend on what this host happens to have installed. */
const everyBinary = { canRun: () => true };
const route = (cmd: string): RouteDecision => routeCommand(cmd, everyBinary);

beforeAll(async () => {
  await initRouter();
  await initRouter(); // idempotent
});

describe('before init', () => {
  it('refuses to route until the parser is loaded', async () => {
    vi.resetModules(); // a fresh copy of the router modules, never initialised
    const fresh = await import('../host-broker/src/router/index.ts');
    expect(() => fresh.routeCommand('ls')).toThrow(/initRouter/);
  });
});

type Row = [command: string, reasonPart?: string];

/** Commands that must run on the fast path. */
const FAST: Row[] = [
  ['ls'],
  ['ls -la src'],
  ['cat README.md'],
  ['cat *.py'],
  ['cat src/*.js test/*.js'],
  ['head -n 5 data/orders.csv && wc -l data/orders.csv'],
  ['tail -n 20 out.log'],
  ['wc -l src/*.js test/*.js'],
  ['wc -l < fixtures/backups.txt'],
  ['sort a.txt | uniq -c | sort -rn | head'],
  ['cut -d, -f1,3 data.csv | head'],
  ["cut -d/ -f2 paths.txt"],
  ['tr a-z A-Z < in.txt'],
  ['diff a.txt b.txt'],
  ['diff -u old/x.py new/x.py'],
  ['cmp a.bin b.bin'],
  ['comm -12 a b'],
  ['nl -ba file.py'],
  ['grep -rn foo . | head'],
  ["grep -E '^(FAIL|ERROR):' test.log"],
  ['grep -rn --include=*.py "def main" .'],
  ['egrep -c "x|y" f'],
  ['fgrep -l needle -r src'],
  ["grep -e /usr/lib -r ."],
  ['! grep -q TODO src/app.js'],
  ["find . -name '*.py' -not -path './venv/*'"],
  ["find src -type f -newer setup.py"],
  ["find . -name '*.pyc' -delete"],
  ["find . -maxdepth 2 -type d | sort"],
  ["sed -n '1,40p' src/app.py"],
  ["sed -i 's/a/b/' file.py"],
  ["sed -i 's/\\btoKebab\\b/kebabCase/g; s/\\btoCamel\\b/camelCase/g' examples/demo.js README.md"],
  ["sed -i.bak -e 's/x/y/' -e '/^#/d' conf.ini"],
  ["sed -E 's/(a|b)+/X/g' f"],
  ["sed -n '$!{N;bx};:x;p' f"],
  ["sed 'y/abc/xyz/' f"],
  ["sed '1a\\\nadded line' f"],
  ["sed -i 's/a/b/' -- *.py"],
  ['echo hi'],
  ['echo hi > out.txt'],
  ['echo x >> notes/log.md'],
  ['printf "%s\\n" a b c > list.txt'],
  ['echo hi > /tmp/x && cat /tmp/x'],
  ['git show HEAD:src/case.js > /tmp/case_before.js && diff /tmp/case_before.js src/case.js'],
  ['mkdir -p /tmp/w && echo 1 > /tmp/w/a && cat /tmp/w/a && rm -r /tmp/w'],
  ['echo hi | tee out.txt'],
  ['echo hi | tee -a out.txt'],
  ['cat <<EOF > out.txt\nhello\nEOF'],
  ["cat <<'EOF' > notes.md\nliteral $HOME and $(id)\nEOF"],
  ['cat <<EOF | grep x\nx line\nEOF'],
  ['cat <<< "text" | wc -c'],
  ['true'],
  ['false || true'],
  [':'],
  ['pwd'],
  ['test -f setup.py && echo yes'],
  ['[ -d src ] || mkdir src'],
  ['[[ -f a.txt && -s a.txt ]]'],
  ['basename /etc/passwd'],
  ['dirname /usr/bin/x'],
  ['realpath src/../README.md'],
  ['readlink -f link'],
  ['stat -c %s file'],
  ['du -sh .'],
  ['md5sum a b'],
  ['sha256sum *.py'],
  ['xxd file.bin | head'],
  ['od -c f | head'],
  ['hexdump -C f'],
  ['column -t data.tsv'],
  ['paste -d, a b'],
  ['fold -w 80 f'],
  ['fmt f'],
  ['rev f'],
  ['tac f'],
  ['seq 1 10'],
  ['touch a/b.txt'],
  ['mkdir -p a/b && touch a/b/c'],
  ['cp a.txt b.txt'],
  ['cp -r src backup/'],
  ['mv old.txt new.txt'],
  ['rm -rf build'],
  ['rm -f *.pyc'],
  ['ln -s a.txt b.txt'],
  ['chmod +x scripts/run.sh'],
  ['chmod 644 a b'],
  ['cd src && ls'],
  ['cd src; pwd'],
  ['cd /work/src && ls'],
  ['(cd sub && ls)'],
  ['{ ls; cat a; } > out'],
  ['ls | wc -l'],
  ['ls |& cat'],
  ['ls 2>/dev/null'],
  ['cat f 2>&1 | head'],
  ['echo >&2 oops'],
  ['> out.txt'],
  ['cat /work/README.md'],
  ['x=src; cat "$x/a.py"'],
  ['dir=src file=a.py; cat "$dir/$file"'],
  ['echo "exit=$?"'],
  ['echo {a,b}.txt'],
  ['cat src/{a,b}.js'],
  ["cat $'a\\tb'"],
  ['cat a\\ b "c d"'],
  ['LC_ALL=C sort f'],
  ['LANG=C.UTF-8 TZ=UTC ls -l'],
  ['NO_COLOR=1 grep x f'],
  ['GIT_PAGER=cat git log -n 1'],
  ['set -euo pipefail; ls'],
  ['time ls'],
  ['exit 0'],
  ['ls # list files'],
  ['git status'],
  ['git status --short'],
  ['git diff'],
  ['git diff --stat'],
  ['git diff logtally/report.py'],
  ['git diff --cached -- src/'],
  ['git log --oneline -n 3'],
  ['git log -p --follow -- src/a.js'],
  ['git show HEAD~1 --stat'],
  ['git ls-files | head'],
  ['git rev-parse --abbrev-ref HEAD'],
  ['git branch'],
  ['git branch -a -v'],
  ['git branch -l "feat*"'],
  ['git blame -L 1,20 src/a.js'],
  ['git grep -n foo'],
  ['git --no-pager diff'],
  ['git -C sub log -n 1'],
  ['jq .by_region out/report.json'],
  ['jq -r ".items[] | .name" data.json'],
  ['jq --arg x /etc/passwd ".a" f.json'],
];

/** Commands that must go to the VM, with a part of the reason. */
const VM: Row[] = [
  ['cat x; curl y', '`curl` is not a read/edit command'],
  ["sed 'w /etc/x' f", 'sed script uses `w` (writes a file)'],
  ["sed 'W out' f", 'sed script uses `W`'],
  ["sed -n 'e id' f", 'sed script uses `e` (runs a command)'],
  ["sed 's/a/b/e' f", '`s///e`'],
  ["sed 's/a/b/w out.txt' f", '`s///w` writes a file'],
  ['sed -n "1r /etc/passwd" f', '`/etc/passwd`, outside the workspace'],
  ['sed -f script.sed f', 'reads its script from a file'],
  ["sed -i 's/a/b/' *.py", 'could expand to a file named like an option'],
  ["sed -i'../../x' s/a/b/ f", 'puts backups in another directory'],
  ["sed 's/[/]/X/' f", 'sed script'],
  ["sed 'k' f", 'sed script command `k` is not recognised'],
  ['find . -exec rm {} \\;', '`find -exec` runs a command'],
  ['find . -execdir cat {} +', '`find -execdir`'],
  ['find . -ok rm {} \\;', '`find -ok`'],
  ['find . -okdir rm {} \\;', '`find -okdir`'],
  ['find . -fprint out.txt', '`find -fprint` writes a file'],
  ['find . -fprintf out.txt %p', '`find -fprintf`'],
  ['find . -fls out.txt', '`find -fls`'],
  ['find / -name passwd', '`/`, outside the workspace'],
  ['find . -newer /etc/passwd', '`/etc/passwd`'],
  ['find . -user root', 'user and group names'],
  ['find . -frobnicate', 'not a recognised find primary'],
  ['echo $(id)', 'command substitution `$(id)` cannot be proven safe'],
  ['echo `id`', 'command substitution'],
  ['wc -l $(git ls-files)', 'command substitution `$(git ls-files)`'],
  ['diff <(sort a) <(sort b)', 'process substitution'],
  ['echo $((1+2))', 'arithmetic expansion'],
  ['(( x++ ))', 'arithmetic command'],
  ['echo ${x:-y}', 'parameter expansion `${x:-y}`'],
  ['echo $HOME', '`$HOME` is not set by this command'],
  ['echo ${HOME}', '`${HOME}`'],
  ['echo $1', '`$1`'],
  ['x="a b"; cat $x', 'would be split or globbed'],
  ['cat ~/.bashrc', 'refers to HOME'],
  ['echo hi > /etc/passwd', 'redirection `> /etc/passwd` writes `/etc/passwd`'],
  ['cat f > /dev/sda', '/dev/sda'],
  // No procfs on the fast path (fastpath/bwrap-argv.ts): these are links into /proc/self/fd.
  ['cat f > /dev/stderr', 'link into /proc/self/fd'],
  ['echo x | tee /dev/stdout', 'link into /proc/self/fd'],
  ['cat /dev/stdin', 'link into /proc/self/fd'],
  ['cat /dev/fd/0', 'link into /proc/self/fd'],
  ['cat < /etc/shadow', 'reads `/etc/shadow`'],
  ['cat f >> ~/.bashrc', 'refers to HOME'],
  ['git -c core.pager=evil log', '`git -c` sets configuration'],
  ['git --config-env=core.pager=X log', '`git --config-env`'],
  ['git --exec-path=/tmp log', '`git --exec-path`'],
  ['git -C /etc log', '`git -C /etc` leaves the workspace'],
  ['git -C .. log', 'leaves the workspace'],
  ['git --git-dir=/x log', '`git --git-dir`'],
  ['git -p log', 'starts a pager'],
  ['git log --output=/tmp/x', '`git log --output` writes a file'],
  ['git diff --ext-diff', 'runs an external diff program'],
  ['git log --show-signature', 'runs gpg'],
  ['git grep -O foo', 'starts a pager'],
  ['git grep --open-files-in-pager=vim foo', 'starts a pager'],
  ['git commit -m x', '`git commit` is not a read-only git subcommand'],
  ['git add -A && git commit -q -m x', '`git add`'],
  ['git config --global user.email a@b', '`git config`'],
  ['git stash', '`git stash`'],
  ['git push', '`git push`'],
  ['git branch new-feature', 'creates a branch'],
  ['git branch -D main', 'changes branches'],
  ['git diff --no-index /etc/passwd a', '`/etc/passwd`'],
  ['GIT_PAGER=less git log', 'only `cat` is allowed as a pager'],
  ['GIT_DIR=/x git log', '`GIT_DIR=`'],
  ['LD_PRELOAD=x cat f', '`LD_PRELOAD=`'],
  ['FOO=bar cat f', '`FOO=`'],
  ['PATH=/tmp:$PATH ls', '`PATH=`'],
  ['TZ=/etc/localtime ls', 'a TZ file path'],
  ['LANG=../../x ls', 'a locale name with `/`'],
  ['IFS=x; ls', 'assigning `IFS`'],
  ['python3 -m unittest', '`python3` is not a read/edit command'],
  ['node --test', '`node`'],
  ['make check', '`make`'],
  ['bash tests/x.sh', '`bash`'],
  ['sh -c ls', '`sh`'],
  ['time python3 x.py', '`python3`'],
  ['./run.sh', 'runs a program by path'],
  ['/usr/bin/cat x', 'runs a program by path'],
  ['awk "{print}" f', '`awk` is not a read/edit command'],
  ['ls | xargs cat', '`xargs`'],
  ['env ls', '`env`'],
  ['exec ls', '`exec`'],
  ['eval ls', '`eval`'],
  ['source x.sh', '`source`'],
  ['. x.sh', '`.`'],
  ['curl https://example.com', '`curl`'],
  ['pip install x', '`pip`'],
  ['npm test', '`npm`'],
  ['cd .. && ls', '`cd ..` leaves the workspace'],
  ['cd', 'goes to HOME'],
  ['cd -', '`cd -`'],
  ['cd /tmp', 'leaves the workspace'],
  ['cd sub && cat ../../x', 'climbs out of the workspace'],
  ['ls /etc', '`ls` reads `/etc`, outside the workspace'],
  ['cat ../x', '`../x`, which climbs out of the workspace'],
  ['cat /work/../etc/passwd', 'outside the workspace'],
  ['cat /etc/*', 'glob `/etc/*`'],
  ['ls .*/x', 'climbs out'],
  ['cat {a,/etc/passwd}', '`/etc/passwd`'],
  ['ls; rm -rf /', '`rm` modifies `/`'],
  ['rm -rf ~', 'refers to HOME'],
  ['cp a /etc/b', '`cp` writes `/etc/b`'],
  ['mv /etc/passwd x', '`mv` modifies `/etc/passwd`'],
  ['ln -s ../../etc/passwd x', 'could point outside the workspace'],
  ['ln -s /etc/passwd x', 'could point outside'],
  ['chmod u+s x', 'setuid'],
  ['chmod 4755 x', 'setuid'],
  ['touch /etc/x', 'outside the workspace'],
  ['tee /etc/x < f', 'outside the workspace'],
  ['sort -o /etc/x f', '`sort -o` writes `/etc/x`'],
  ['sort --compress-program=gzip f', '`sort --compress-program` runs a program'],
  ['sort --compress-prog=sh f', '`sort --compress-program`'],
  ['tail -f app.log', 'follows the file forever'],
  ['tail -n 20 -F app.log', 'follows'],
  ['md5sum -c sums.txt', 'checksum list'],
  ['file -z x.gz', 'decompressors'],
  ['uniq a /etc/b', '`uniq` writes `/etc/b`'],
  ['jq env f.json', 'jq filter uses `env`'],
  ['jq "$ENV.HOME" f.json', 'is not set by this command'],
  ["jq '$ENV.HOME' f.json", 'jq filter uses `$ENV`'],
  ['jq -f prog.jq f.json', 'reads its filter from a file'],
  ['jq --rawfile x /etc/passwd . f.json', '`jq --rawfile` reads `/etc/passwd`'],
  ['cat /tmp/report.json', 'which this command did not write'],
  ['ls /tmp', 'which this command did not write'],
  ['echo hi | tee /tmp/x', 'never reads it back'],
  ['git diff > /tmp/patch.diff', 'never reads it back'],
  ['echo x >> /tmp/log && cat /tmp/log', 'did not write'],
  ['echo x > /tmp/nodir/f && cat /tmp/nodir/f', 'did not create'],
  ['rm /tmp/x', 'did not write'],
  ['cat /tmp/*.json', 'in /tmp'],
  ['ls &', 'background job `&`'],
  ['ls & wait', 'background'],
  ['f() { ls; }; f', 'function definition'],
  ['if true; then ls; fi', '`if` blocks are not analysed'],
  ['for f in *.py; do wc -l $f; done', '`for`'],
  ['while true; do ls; done', '`while`'],
  ['case x in x) ls;; esac', '`case`'],
  ['export X=1', '`export` changes shell state'],
  ['local x=1', '`local`'],
  ['unset x', '`unset`'],
  ['echo "unterminated', 'cannot parse'],
  ['ls )', 'cannot parse'],
  ['set +H; ls', '`set +H`'],
  ['set -o vi', '`set -o vi`'],
  ['[[ "a[$(id)]" -eq 1 ]]', 'command substitution'],
  ["[[ 'a[$(id)]' -eq 1 ]]", 'arithmetic evaluation'],
  ['[ -f /etc/passwd ]', '`/etc/passwd`'],
  ['head -c 10 /dev/sda', '/dev/sda'],
  ['echo {1..3}', 'brace sequence'],
  ['ls > *.txt', 'is a glob'],
  ['cat $"msg"', 'locale string'],
  ['a && b > x', '`a` is not a read/edit command'],
  ['a=(1 2); ls', 'array assignment'],
  ['mkdir -p ~/.cache/x && python3 -m cProfile -o ~/.cache/x/p.prof -m m', 'refers to HOME'],
];

describe('routeCommand table', () => {
  it('has at least 120 commands both ways', () => {
    expect(FAST.length).toBeGreaterThanOrEqual(120);
    expect(VM.length).toBeGreaterThanOrEqual(120);
  });

  it.each(FAST)('fast path: %s', (cmd) => {
    const d = route(cmd);
    expect(d, d.reason).toMatchObject({ route: 'fastpath' });
    expect(d.reason.length).toBeGreaterThan(0);
  });

  it.each(VM)('VM: %s', (cmd, part) => {
    const d = route(cmd);
    expect(d.route, `${cmd} -> ${d.reason}`).toBe('vm');
    if (part) expect(d.reason).toContain(part);
    // One short sentence: no line breaks, bounded length.
    expect(d.reason).not.toContain('\n');
    expect(d.reason.length).toBeLessThan(200);
  });
});

describe('decision details', () => {
  it('lists commands and the paths a fast-path command writes', () => {
    const d = route("mkdir -p out && sed -i 's/a/b/' a.py && echo x > out/log.txt");
    expect(d.commands).toEqual(['mkdir', 'sed', 'echo']);
    expect(d.writes).toEqual(['out', 'a.py', 'out/log.txt']);
    expect(d.code).toBe('fastpath');
  });

  it('gives a machine-readable code for each kind of refusal', () => {
    expect(route('curl x').code).toBe('not_allowed');
    expect(route('echo $(id)').code).toBe('construct');
    expect(route('echo "x').code).toBe('syntax');
    expect(route('cat /etc/passwd').code).toBe('path');
    expect(route('cat /tmp/x').code).toBe('tmp');
    expect(route('FOO=1 ls').code).toBe('environment');
    expect(route("sed 'w x' f").code).toBe('script');
    expect(route('sort --compress-program=x f').code).toBe('option');
    expect(route('echo $HOME').code).toBe('expansion');
  });

  it('routes empty commands and comments to the fast path', () => {
    expect(route('').route).toBe('fastpath');
    expect(route('   ').code).toBe('empty');
    expect(route('# nothing to do').code).toBe('empty');
  });

  it('sends over-long commands to the VM without parsing them', () => {
    const d = route(`echo ${'x'.repeat(300 * 1024)}`);
    expect(d).toMatchObject({ route: 'vm', code: 'too_long' });
  });

  it("bounds one command's work on the broker's loop: syntax past the budget goes to the VM unanalysed", () => {
    // Each of these is under MAX_ROUTED_LENGTH and held the loop for 0.1-3 s (at 256 KiB).
    const n = MAX_SYNTAX_NODES;
    const heavy = [
      'ls ' + 'a '.repeat(n),
      'cat a' + ' | cat a'.repeat(n / 2),
      'echo ' + '"a"'.repeat(n),
      'ls' + '; ls'.repeat(n),
      'echo ' + '$('.repeat(n) + ')'.repeat(n),
      'cat > f.sh <<EOF\n' + 'echo $x and $y\n'.repeat(n) + 'EOF',
      'find . ' + '-name x -o '.repeat(n / 2) + '-name y',
    ];
    for (const c of heavy) {
      expect(c.length, c.slice(0, 20)).toBeLessThanOrEqual(MAX_ROUTED_LENGTH);
      expect(route(c), c.slice(0, 20)).toMatchObject({ route: 'vm', code: 'too_complex' });
    }
    // Within the budget a long command is still analysed, and a cancelled parse leaves
    // nothing behind in the parser for the next command.
    expect(route('ls ' + 'a '.repeat(n / 4))).toMatchObject({ route: 'fastpath' });
    expect(route('cat a.txt')).toMatchObject({ route: 'fastpath', commands: ['cat'] });
    // Nesting deeper than the analysis recurses is a route, not a thrown RangeError.
    const deep = '('.repeat(n / 3) + 'ls' + ')'.repeat(n / 3);
    expect(() => route(deep)).not.toThrow();
    expect(route(deep).route).toBe('vm');
  });

  it('expands brace lists in one pass per group, and refuses one that would explode', () => {
    // Words as the parser gives them (a whole command this size is past the node budget, but
    // the expansion must not rely on that): unquoted text.
    const word = (text: string) => ({ parts: [{ kind: 'text' as const, text, quoted: false }], source: text, start: 5 });
    // 20,000 unclosed `{a,`: matched from each `{` in turn this took minutes.
    const open = 'x' + '{a,'.repeat(20_000);
    expect(expandWord(word(open), new Map())).toMatchObject({ ok: true, words: [{ value: open }] });
    // Nested groups: few words, but each one as long as the whole word.
    const nested = 'x'.repeat(20_000) + '{a,'.repeat(200) + 'b' + '}'.repeat(200);
    expect(expandWord(word(nested), new Map())).toMatchObject({ ok: false, reason: expect.stringMatching(/too many words/) });
    // Ordinary lists still expand as bash does.
    expect(expandWord(word('{a,{b,c}}d{x}'), new Map())).toMatchObject({ ok: true, words: [{ value: 'ad{x}' }, { value: 'bd{x}' }, { value: 'cd{x}' }] });
    expect(expandWord(word('{x}{a,b}'), new Map())).toMatchObject({ ok: true, words: [{ value: '{x}a' }, { value: '{x}b' }] });
  });

  it('tracks variables assigned earlier in the same command', () => {
    expect(route('f=README.md; cat "$f"').route).toBe('fastpath');
    expect(route('f=/etc/passwd; cat "$f"').reason).toContain('`/etc/passwd`');
    expect(route('f=x; f+=/../../y; cat "$f"').route).toBe('vm');
    // A prefix assignment is not a shell variable afterwards.
    expect(route('LC_ALL=C ls; cat "$LC_ALL"').route).toBe('vm');
  });

  it('treats cd conservatively: a failed cd leaves the shell where it was', () => {
    expect(route('cd a/b && cat ../x').route).toBe('vm');
    expect(route('cd a/b && cat x').route).toBe('fastpath');
    expect(route('cd a && cd .. && ls').route).toBe('vm');
  });

  it('sends tools that read HOME config to the VM once that config changed there', () => {
    const git = (homeChanged: boolean | string[]) => routeCommand('git log -n 1', { ...everyBinary, homeChanged });
    expect(git(false).route).toBe('fastpath');
    expect(git([]).route).toBe('fastpath');
    expect(git(['.cache/salesreport/report.prof']).route).toBe('fastpath');
    const d = git(true);
    expect(d).toMatchObject({ route: 'vm', code: 'home' });
    expect(d.reason).toContain('~/.gitconfig');
    expect(git(['.gitconfig']).route).toBe('vm');
    expect(git(['~/.config/git/config']).route).toBe('vm');
    expect(routeCommand('jq . f.json', { ...everyBinary, homeChanged: ['.jq'] }).route).toBe('vm');
    expect(routeCommand('cat a', { ...everyBinary, homeChanged: true }).route).toBe('fastpath');
  });

  it('sends commands the sandbox cannot run to the VM', () => {
    const d = routeCommand('jq . f.json', { canRun: (n) => n !== 'jq' });
    expect(d).toMatchObject({ route: 'vm', code: 'host' });
    // Builtins need no binary.
    expect(routeCommand('echo hi; pwd', { canRun: () => false }).route).toBe('fastpath');
  });
});

describe('host binary probe', () => {
  let root: string;
  beforeAll(() => {
    // A miniature host: /usr/bin/real, /usr/bin/viaetc -> /etc/alternatives/x -> /usr/bin/real,
    // /usr/bin/rel -> real, /usr/bin/dangling -> nowhere.
    root = mkdtempSync(join(tmpdir(), 'hutch-router-host-'));
    mkdirSync(join(root, 'usr/bin'), { recursive: true });
    mkdirSync(join(root, 'etc/alternatives'), { recursive: true });
    writeFileSync(join(root, 'usr/bin/real'), '#!/bin/sh\n', { mode: 0o755 });
    writeFileSync(join(root, 'usr/bin/noexec'), 'data', { mode: 0o644 });
    symlinkSync('/usr/bin/real', join(root, 'etc/alternatives/x'));
    symlinkSync('/etc/alternatives/x', join(root, 'usr/bin/viaetc'));
    symlinkSync('real', join(root, 'usr/bin/rel'));
    symlinkSync('/usr/bin/missing', join(root, 'usr/bin/dangling'));
  });
  afterAll(() => rmSync(root, { recursive: true, force: true }));

  it('accepts binaries that resolve inside /usr and refuses ones reached through /etc', () => {
    expect(sandboxCanRun('real', root)).toBe(true);
    expect(sandboxCanRun('rel', root)).toBe(true);
    expect(sandboxCanRun('viaetc', root)).toBe(false);
    expect(sandboxCanRun('dangling', root)).toBe(false);
    expect(sandboxCanRun('noexec', root)).toBe(false);
    expect(sandboxCanRun('absent', root)).toBe(false);
  });

  it('probes every fast-path binary on this host at init', () => {
    const report = hostBinaryReport();
    expect([...report.keys()].sort()).toEqual([...FASTPATH_BINARIES]);
    // coreutils are present on any Debian host this runs on.
    expect(report.get('cat')).toBe(true);
    expect(report.get('sed')).toBe(true);
  });
});

describe('sed script analysis', () => {
  it.each<[string, boolean]>([
    ['s/a/b/g', true],
    ['1d;$d', true],
    ['/start/,/end/{s/x/y/;p}', true],
    ['\\%/usr%d', true],
    ['0,/re/s//X/', true],
    ['1~2p', true],
    ['2,+3!d', true],
    ['s|a|b|w out', false],
    ['s/a/b/;w out', false],
    ['1a text; w out', true], // `a` text runs to the end of the line: no w command here
    ['1a text\nw out', false],
    ['bx}w out', false],
    ['s/a/b/3pI', true],
    ['s/a/b', false],
    ['y/ab/c/', true],
    ['# comment\np', true],
    ['l 70', true],
    ['q5', true],
  ])('%j accepted: %s', (script, ok) => {
    expect(analyseSed(script).ok).toBe(ok);
  });

  it('returns files read by r and R for path checks', () => {
    expect(analyseSed('1r header.txt\n$R /tmp/x')).toEqual({ ok: true, reads: ['header.txt', '/tmp/x'] });
  });
});

describe('parser adapter', () => {
  it('gives words after a redirection target back to the command', () => {
    const s = parseScript('echo >&2 hi there');
    const step = s.steps[0];
    expect(step?.kind).toBe('command');
    if (step?.kind !== 'command') return;
    expect(step.words.map((w) => w.source)).toEqual(['echo', 'hi', 'there']);
    expect(step.redirects.map((r) => [r.op, r.target?.source])).toEqual([['>&', '2']]);
  });

  it('unnests pipelines and lists the grammar puts inside a here-document', () => {
    const s = parseScript('cat <<EOF | grep x && curl y\nbody\nEOF');
    const names = s.steps.flatMap((st) => (st.kind === 'command' ? [st.words[0]?.source] : []));
    expect(names).toEqual(['cat', 'grep', 'curl']);
  });

  it('keeps quoting so globs and tildes apply only to unquoted characters', () => {
    expect(route('cat "*.py"').route).toBe('fastpath');
    expect(route("cat '/etc/'*").route).toBe('vm');
    expect(route('cat "~/x"').route).toBe('fastpath');
    expect(route('cat "{a,/etc/passwd}"').route).toBe('fastpath');
  });

  it('gives a redirection after a list or pipeline to its last command, as bash does', () => {
    // The grammar parses `a && b > x` as `(a && b) > x`.
    for (const src of ['ls && cat a > out', 'ls | cat > out', '! ls && cat a > out']) {
      const s = parseScript(src);
      const redirectsOf = s.steps.map((st) => (st.kind === 'command' ? st.redirects.map((r) => r.target?.source) : ['?']));
      expect(redirectsOf, src).toEqual([[], ['out']]);
    }
    expect(route('mkdir -p /tmp/w && echo 1 > /tmp/w/a && cat /tmp/w/a').route).toBe('fastpath');
  });

  it('reports syntax errors instead of guessing', () => {
    const s = parseScript('cat <<EOF arg > out\nx\nEOF');
    expect(s.problems[0]?.code).toBe('syntax');
  });
});
