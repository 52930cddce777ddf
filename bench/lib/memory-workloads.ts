/**
 * Long-lived guest workloads for the memory manager's tests and benches: a process that
 * starts once inside the VM and survives between calls (a REPL, a language server), and
 * a call that talks to it. Each exec is a new process, so a call reaches the server
 * through a pair of FIFOs in /tmp: it writes one request line and reads one reply.
 */
import { readdirSync, readFileSync, statSync } from 'node:fs';
import { join, relative } from 'node:path';
import type { AgentClient } from '../../host-broker/src/agent-client.ts';
import { PROJECTS_DIR } from './sessions.ts';

export interface LongLivedWorkload {
  name: string;
  /** Shared bench projects copied to /work/<project> before the server starts. */
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
 * and per request runs the unittest suites of three bench projects in-process (modules
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
def run_tests():
    total = failed = 0
    for p in projects:
        root = "/work/" + p
        if root not in sys.path:
            sys.path.insert(0, root)
        suite = unittest.defaultTestLoader.discover(root + "/tests", top_level_dir=root)
        r = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(suite)
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
const [name, root] = process.argv.slice(2);
const IN = '/tmp/' + name + '.in', OUT = '/tmp/' + name + '.out';
const files = [];
(function walk(d) {
  for (const e of fs.readdirSync(d, { withFileTypes: true })) {
    const p = path.join(d, e.name);
    if (e.isDirectory()) walk(p);
    else if (p.endsWith('.js')) files.push({ path: p, text: fs.readFileSync(p, 'utf8') });
  }
})(root);
// A mid-sized repository: the project's files, 300 times over under different names.
const docs = [];
for (let i = 0; i < 300; i++) for (const f of files) docs.push({ uri: 'file://' + i + '/' + f.path, text: f.text.replace(/function (\w+)/g, 'function $1_' + i) });
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

export const PYTHON_REPL: LongLivedWorkload = {
  name: 'python',
  projects: ['datespan', 'logtally', 'salesreport'],
  file: 'py_server.py',
  source: PY_SERVER,
  start: `python3 -B ${DIR}/py_server.py python datespan logtally salesreport`,
  request: 'run',
};

export const NODE_LSP: LongLivedWorkload = {
  name: 'node',
  projects: ['textkit'],
  file: 'lsp_server.js',
  source: NODE_SERVER,
  start: `node --max-semi-space-size=8 ${DIR}/lsp_server.js node /work/textkit`,
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
  for (const p of w.projects) await pushDir(agent, join(PROJECTS_DIR, p), p);
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
