/**
 * Long-lived guest workloads for the memory manager's tests and benches: a process that
 * starts once inside the VM and survives between calls (a REPL, a language server), and
 * a call that talks to it. Each exec is a new process, so a call reaches the server
 * through a pair of FIFOs in /tmp: it writes one request line and reads one reply.
 */
import { existsSync, readdirSync, readFileSync, statSync } from 'node:fs';
import { dirname, join, relative, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { AgentClient } from '../../host-broker/src/agent-client.ts';
import { EXAMPLE_PROJECTS } from './sessions.ts';

/**
 * Where the workloads' projects come from: the repository's own (the example projects and
 * a test fixture), so the tests that start a workload need nothing beside the clone.
 */
export const WORKLOAD_PROJECT_DIRS = [EXAMPLE_PROJECTS, resolve(dirname(fileURLToPath(import.meta.url)), '../../test/fixtures/projects')];

/** A workload project's directory on the host (the first of WORKLOAD_PROJECT_DIRS that has it). */
export function workloadProjectDir(name: string): string {
  const dir = WORKLOAD_PROJECT_DIRS.map((d) => join(d, name)).find((d) => existsSync(d));
  if (!dir) throw new Error(`workload project ${name} is in none of ${WORKLOAD_PROJECT_DIRS.join(', ')}`);
  return dir;
}

export interface LongLivedWorkload {
  name: string;
  /** Projects (workloadProjectDir) copied to /work/<project> before the server starts. */
  projects: string[];
  /** The server's source, written to /work/.hutch-mem/<file>. */
  file: string;
  source: string;
  /** Command that starts the server (detached, in the workload cgroup). */
  start: string;
  /** The request a call sends. */
  request: string;
}

const DIR = '/work/.hutch-mem';

/**
 * Python REPL-like server: imports a large part of the stdlib, keeps ~20 MiB of state,
 * and per request runs the unittest suites of its projects in-process (modules
 * stay imported between calls, as in a REPL) and walks its state.
 */
const PY_SERVER = String.raw`
import os, sys, io, time, unittest
import json, re, csv, argparse, datetime, decimal, fractions, statistics, difflib, textwrap
import collections, itertools, functools, heapq, bisect, pathlib, tempfile, logging, typing
import dataclasses, enum, string, struct, hashlib, base64, uuid, random, math, sqlite3
import xml.etree.ElementTree, email.message, urllib.parse, http.client, pprint, shlex, glob
import asyncio, concurrent.futures, subprocess, inspect, ast, tokenize, dis, pickle, copy
name = sys.argv[1]
projects = sys.argv[2:]
state = {i: ("%08d" % i) * 6 for i in range(250000)}
IN, OUT = "/tmp/%s.in" % name, "/tmp/%s.out" % name
for p in (IN, OUT):
    if not os.path.exists(p):
        os.mkfifo(p)
# Every project's suite is a package named tests: each project keeps its own imported
# test modules, swapped into sys.modules for its run (imported once, as in a REPL).
test_modules = {}
def swap_tests(p):
    for k in [k for k in sys.modules if k == "tests" or k.startswith("tests.")]:
        del sys.modules[k]
    sys.modules.update(test_modules.get(p, {}))
def run_tests():
    total = failed = 0
    for p in projects:
        root = "/work/" + p
        if root not in sys.path:
            sys.path.insert(0, root)
        swap_tests(p)
        suite = unittest.defaultTestLoader.discover(root + "/tests", top_level_dir=root)
        r = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(suite)
        test_modules[p] = {k: m for k, m in sys.modules.items() if k == "tests" or k.startswith("tests.")}
        total += r.testsRun
        failed += len(r.failures) + len(r.errors)
    walked = sum(len(v) for v in state.values())
    return {"tests": total, "failed": failed, "walked": walked}
open("/tmp/%s.ready" % name, "w").close()
while True:
    with open(IN) as f:
        req = f.readline().strip()
    t = time.monotonic()
    out = run_tests() if req == "run" else {"error": "unknown request " + req}
    out["ms"] = round((time.monotonic() - t) * 1000, 1)
    with open(OUT, "w") as f:
        f.write(json.dumps(out) + "\n")
`;

/**
 * Node language-server-like process: loads a project's sources (replicated to the size of
 * a mid-sized repository), keeps a token index in memory, and per request answers a
 * "find references" plus "document symbols" query over all of it.
 */
const NODE_SERVER = String.raw`
'use strict';
const fs = require('fs');
const path = require('path');
const [name, root, copies] = process.argv.slice(2);
const IN = '/tmp/' + name + '.in', OUT = '/tmp/' + name + '.out';
const files = [];
(function walk(d) {
  for (const e of fs.readdirSync(d, { withFileTypes: true })) {
    const p = path.join(d, e.name);
    if (e.isDirectory()) walk(p);
    else if (p.endsWith('.js')) files.push({ path: p, text: fs.readFileSync(p, 'utf8') });
  }
})(root);
// A mid-sized repository: the project's files, many times over under different names.
const docs = [];
for (let i = 0; i < Number(copies); i++) for (const f of files) docs.push({ uri: 'file://' + i + '/' + f.path, text: f.text.replace(/function (\w+)/g, 'function $1_' + i) });
const index = new Map();
function tokenize(doc) {
  const toks = [];
  const re = /[A-Za-z_$][\w$]*/g;
  let m;
  while ((m = re.exec(doc.text))) toks.push({ name: m[0], at: m.index });
  return toks;
}
for (const d of docs) {
  d.tokens = tokenize(d);
  for (const t of d.tokens) {
    let refs = index.get(t.name);
    if (!refs) index.set(t.name, (refs = []));
    refs.push([d.uri, t.at]);
  }
}
function handle(req) {
  const [, symbol] = req.split(' ');
  const refs = (index.get(symbol) || []).length;
  let symbols = 0;
  for (const d of docs) for (const t of d.tokens) if (t.name === 'function' || t.name === 'const') symbols++;
  return { refs, symbols, docs: docs.length, names: index.size };
}
try { require('child_process').execFileSync('mkfifo', [IN, OUT]); } catch {}
fs.writeFileSync('/tmp/' + name + '.ready', '');
for (;;) {
  const req = fs.readFileSync(IN, 'utf8').trim();
  const t = process.hrtime.bigint();
  const out = handle(req);
  out.ms = Number(process.hrtime.bigint() - t) / 1e6;
  fs.writeFileSync(OUT, JSON.stringify(out) + '\n');
}
`;

/** invoicer's suite has one failing test on purpose: the server counts it, the same on every call. */
export const PYTHON_REPL: LongLivedWorkload = {
  name: 'python',
  projects: ['invoicer', 'datespan'],
  file: 'py_server.py',
  source: PY_SERVER,
  start: `python3 -B ${DIR}/py_server.py python invoicer datespan`,
  request: 'run',
};

/**
 * slugkit's .js files (1.3 KB) 1,900 times over: about the 2.5 MB of text the server held
 * when it replicated a 8 KB project 300 times.
 */
export const NODE_LSP: LongLivedWorkload = {
  name: 'node',
  projects: ['slugkit'],
  file: 'lsp_server.js',
  source: NODE_SERVER,
  start: `node --max-semi-space-size=8 ${DIR}/lsp_server.js node /work/slugkit 1900`,
  request: 'references slugify',
};

/** Copies a host directory into the guest's workspace through the agent's file tools. */
export async function pushDir(agent: AgentClient, hostDir: string, guestRel: string): Promise<number> {
  let n = 0;
  const walk = async (d: string) => {
    for (const e of readdirSync(d)) {
      if (e === '.git') continue;
      const p = join(d, e);
      if (statSync(p).isDirectory()) await walk(p);
      else {
        await agent.call('fs.write', { path: join(guestRel, relative(hostDir, p)), content: readFileSync(p) });
        n++;
      }
    }
  };
  await walk(hostDir);
  return n;
}

/** Puts the workload's projects and server into the guest and starts the server; resolves once it is ready. */
export async function startWorkload(agent: AgentClient, w: LongLivedWorkload, timeoutMs = 300_000): Promise<void> {
  for (const p of w.projects) await pushDir(agent, workloadProjectDir(p), p);
  await agent.call('fs.write', { path: `.hutch-mem/${w.file}`, content: w.source });
  // The agent moves a command into the workload cgroup just after spawning it; a child the
  // shell forks before that stays in the agent's cgroup, out of reach of memory.reclaim and
  // activation sets (a race a loaded host loses). So the shell first waits, with builtins
  // only (no fork), until it is in the workload cgroup.
  const inWorkload = 'while read -r cg < /proc/$$/cgroup; [[ $cg != *workload* ]]; do :; done';
  // setsid + redirections: the server must not hold the call's pipes, or the call would
  // wait for it; it stays in the workload cgroup and lives on between calls.
  const r = await agent.run({ command: `${inWorkload}; rm -f /tmp/${w.name}.ready; setsid ${w.start} > /tmp/${w.name}.log 2>&1 < /dev/null & echo started` });
  if (r.exitCode !== 0) throw new Error(`starting ${w.name} failed: ${r.stderrText}`);
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const ready = await agent.run({ command: `test -e /tmp/${w.name}.ready && echo yes || { sleep 0.5; cat /tmp/${w.name}.log | tail -3; }` });
    if (ready.stdoutText.startsWith('yes')) break;
    if (Date.now() > deadline) throw new Error(`${w.name} server not ready after ${timeoutMs} ms: ${ready.stdoutText}`);
  }
  const st = await agent.call('mem.status', {});
  if (st.workload.cgroup && st.workload.processes === 0) throw new Error(`${w.name} server is not in the workload cgroup ${st.workload.cgroup}`);
}

export interface CallResult {
  /** Wall time of the call seen from the host (exec round trip), ms. */
  wallMs: number;
  reply: Record<string, unknown>;
}

/** One call to the long-lived server: a short process writes the request and reads the reply. */
export async function callWorkload(agent: AgentClient, w: LongLivedWorkload): Promise<CallResult> {
  const t0 = performance.now();
  const r = await agent.run({ command: `printf '%s\\n' '${w.request}' > /tmp/${w.name}.in && cat /tmp/${w.name}.out`, timeoutMs: 600_000 });
  const wallMs = performance.now() - t0;
  if (r.exitCode !== 0) throw new Error(`${w.name} call failed (exit ${r.exitCode}): ${r.stderrText}`);
  return { wallMs, reply: JSON.parse(r.stdoutText) as Record<string, unknown> };
}
