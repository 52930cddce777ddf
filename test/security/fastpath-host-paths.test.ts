import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { chmodSync, existsSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { randomBytes } from 'node:crypto';
import { noopLogger } from '../../guest-agent/src/log.ts';
import { FastPath } from '../../host-broker/src/fastpath/index.ts';

/**
 * Issue 12, item 10: a fast-path tenant read the workspace's host path (so the broker's data
 * dir and the session id) from /proc/self/mountinfo, and bwrap's argv (/proc/1/cmdline)
 * repeated it. Walks everything readable under the sandbox's /proc (every visible pid's
 * files, /proc/self, thread-self, readlinks included) plus the environment, and looks on
 * the host side for the host paths and a secret in the broker's environment. The script
 * itself names none of them, so its own cmdline cannot match. On the main before the fix
 * this failed: /proc/<pid>/mountinfo and mounts showed `<data dir>/.../ws /work`.
 */
const SECRET_ENV = 'HUTCH_TEST_BROKER_TOKEN';
const bwrapPresent = existsSync('/usr/bin/bwrap');
if (!bwrapPresent) console.log('SKIPPING fastpath-host-paths: bubblewrap is not installed (/usr/bin/bwrap)');

describe.skipIf(!bwrapPresent)('fast path: no host path or broker secret is readable inside', () => {
  let fp: FastPath;
  let dataDir: string;
  let ws: string;
  const secret = `tok-${randomBytes(8).toString('hex')}`;

  beforeAll(async () => {
    process.env[SECRET_ENV] = secret;
    dataDir = mkdtempSync(join(tmpdir(), 'hutch-datadir-marker-'));
    chmodSync(dataDir, 0o755);
    ws = join(dataDir, 'sessions', 'sess-marker-0123', 'ws');
    mkdirSync(ws, { recursive: true });
    writeFileSync(join(ws, 'a.txt'), 'hello\n');
    fp = await FastPath.create({ log: noopLogger });
  });

  afterAll(async () => {
    await fp?.close();
    delete process.env[SECRET_ENV];
    if (dataDir) rmSync(dataDir, { recursive: true, force: true });
  });

  it('shows neither the workspace nor the data dir path in any /proc file, link or the environment', async () => {
    let out = '';
    let err = '';
    // A background child so that more than the shell's own pids are there to look at.
    const command = [
      'sleep 30 & bg=$!',
      'env',
      'pwd -P',
      'find /proc -path /proc/sys -prune -o -type l -printf "LINK %p -> %l\\n" 2>/dev/null',
      // Every readable file, pids included, each up to 256 KiB (head prints each name first).
      'find /proc -path /proc/sys -prune -o -type f -readable -print0 2>/dev/null | xargs -0 -r head -c 262144 2>/dev/null | tr "\\0" "\\n"',
      // The sysctls (host tables, read-only) as `path:value` lines.
      'grep -rsI . /proc/sys 2>/dev/null',
      'cat /proc/sys/kernel/ostype',
      'kill $bg',
      'echo walked',
    ].join('; ');
    const r = await fp.run({
      command,
      workspace: ws,
      timeoutMs: 120_000,
      maxOutputBytes: 256 * 1024 * 1024,
      onStdout: (c) => void (out += c.toString('latin1')),
      onStderr: (c) => void (err += c.toString('latin1')),
    });
    expect(r.exitCode, err).toBe(0);
    // The walk ran to its end and read something real.
    expect(out).toContain('walked\n');
    expect(out).toContain('Linux\n');
    expect(out).toContain('PATH=');
    expect(out).toContain('/work\n');
    for (const needle of [ws, dataDir, basename(dataDir), 'sess-marker-0123', secret, 'hutch-fastpath-etc-']) {
      const at = out.indexOf(needle);
      expect(at, `"${needle}" is readable inside: ...${out.slice(Math.max(0, at - 300), at + 200)}...`).toBe(-1);
    }
  });

  it('still runs the read tools without procfs', async () => {
    let out = '';
    let err = '';
    const r = await fp.run({
      command: 'ls; cat a.txt; grep -rn hello .; sed -n 1p a.txt; find . -name "*.txt"; echo a b | xargs -n1 echo; git init -q . && git status --short; wc -l < a.txt; sort a.txt | uniq -c | head -1; echo to-stderr >&2',
      workspace: ws,
      onStdout: (c) => void (out += c.toString()),
      onStderr: (c) => void (err += c.toString()),
    });
    expect(err).toBe('to-stderr\n');
    expect(r.exitCode).toBe(0);
    expect(out).toContain('./a.txt:1:hello\n');
    expect(out).toContain('a\nb\n');
    expect(out).toContain('?? a.txt\n');
    rmSync(join(ws, '.git'), { recursive: true, force: true });
  });
});
