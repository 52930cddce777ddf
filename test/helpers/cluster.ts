/**
 * A cluster on this machine from real processes: redis-server as the catalog, brokers
 * (`hutch serve --catalog ...`, unsafe-local backend: file calls are in-process anyway) and
 * gateways (`hutch gateway`). Used by the gateway tests and bench. Each process gets its own
 * process group so a SIGKILL takes its helpers with it.
 */
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { mkdirSync, writeFileSync } from 'node:fs';
import { createServer } from 'node:net';
import { join, resolve } from 'node:path';
import { RespClient } from '../../host-broker/src/catalog/resp.ts';

const repo = resolve(import.meta.dirname, '../..');

export const TENANTS = { alice: 'alice-token-0123456789abcdef', bob: 'bob-token-0123456789abcdef00' } as const;
export const GATEWAY_CREDENTIAL = 'gateway-credential-0123456789abcdef0123456789';

/** Why a cluster cannot run here, or undefined when it can. */
export function clusterSkipReason(): string | undefined {
  const r = spawnSync('redis-server', ['--version'], { encoding: 'utf8' });
  if (r.error || r.status !== 0) return 'redis-server is not installed (./hutch setup installs it: apt-get install redis-server)';
  const bw = spawnSync('bwrap', ['--version'], { encoding: 'utf8' });
  if (bw.error || bw.status !== 0) return 'bubblewrap (bwrap) is not installed: the unsafe-local brokers need it';
  return undefined;
}

export async function freePort(): Promise<number> {
  return new Promise((res, rej) => {
    const s = createServer();
    s.once('error', rej);
    s.listen(0, '127.0.0.1', () => {
      const port = (s.address() as { port: number }).port;
      s.close(() => res(port));
    });
  });
}

export interface Proc {
  p: ChildProcess;
  exited: Promise<number | null>;
  output: () => string;
  /** Signals the whole process group. */
  kill(sig: NodeJS.Signals): void;
}

function start(cmd: string, args: string[], env: NodeJS.ProcessEnv = {}): Proc {
  const p = spawn(cmd, args, { cwd: repo, env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'], detached: true });
  let out = '';
  p.stdout?.on('data', (d: Buffer) => (out += d.toString()));
  p.stderr?.on('data', (d: Buffer) => (out = (out + d.toString()).slice(-20_000)));
  const exited = new Promise<number | null>((res) => p.once('exit', (code) => res(code)));
  return {
    p,
    exited,
    output: () => out,
    kill(sig) {
      try {
        if (p.pid !== undefined) process.kill(-p.pid, sig);
      } catch {
        // already gone
      }
    },
  };
}

async function firstJsonLine(proc: Proc, what: string): Promise<Record<string, unknown>> {
  return new Promise((res, rej) => {
    let buf = '';
    const onData = (d: Buffer) => {
      buf += d.toString();
      const nl = buf.indexOf('\n');
      if (nl >= 0) {
        proc.p.stdout?.off('data', onData);
        try {
          res(JSON.parse(buf.slice(0, nl)) as Record<string, unknown>);
        } catch {
          rej(new Error(`${what}: not a JSON ready line: ${buf.slice(0, 500)}`));
        }
      }
    };
    proc.p.stdout?.on('data', onData);
    void proc.exited.then((code) => rej(new Error(`${what} exited ${code} before it was ready: ${proc.output().slice(-3000)}`)));
  });
}

export interface Cluster {
  work: string;
  redisUrl: string;
  redis: Proc;
  catalog: RespClient;
  tokensFile: string;
  credentialFile: string;
  startBroker(id: string, o?: { leaseMs?: number; templates?: string[]; dataDir?: string; backend?: 'unsafe-local' | 'qemu'; args?: string[] }): Promise<Broker>;
  startGateway(o?: { sample?: number; maxConnections?: number; args?: string[] }): Promise<GatewayProc>;
  /** SIGKILLs redis-server (its data is not persisted) and starts an empty one on the same port. */
  restartRedis(): Promise<void>;
  stopAll(): Promise<void>;
}

export interface Broker extends Proc {
  id: string;
  url: string;
  dataDir: string;
}

export interface GatewayProc extends Proc {
  url: string;
}

export async function startCluster(work: string): Promise<Cluster> {
  mkdirSync(work, { recursive: true });
  const tokensFile = join(work, 'tokens');
  writeFileSync(tokensFile, Object.entries(TENANTS).map(([n, t]) => `${n}:${t}`).join('\n') + '\n', { mode: 0o600 });
  const credentialFile = join(work, 'gateway-credential');
  writeFileSync(credentialFile, `${GATEWAY_CREDENTIAL}\n`, { mode: 0o600 });
  const port = await freePort();
  const startRedis = () => start('redis-server', ['--port', String(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no', '--dir', work]);
  let redis = startRedis();
  const redisUrl = `redis://127.0.0.1:${port}`;
  const catalog = new RespClient({ host: '127.0.0.1', port });
  const redisUp = async () => {
    for (let i = 0; ; i++) {
      try {
        if ((await catalog.command('PING')) === 'PONG') return;
      } catch (err) {
        if (i > 100) throw new Error(`redis-server did not come up: ${(err as Error).message} ${redis.output()}`);
        await new Promise((r) => setTimeout(r, 50));
      }
    }
  };
  await redisUp();
  const procs: Proc[] = [redis];
  const cli = 'host-broker/src/cli.ts';
  const self: Cluster = {
    work,
    redisUrl,
    redis,
    catalog,
    tokensFile,
    credentialFile,
    async startBroker(id, o = {}) {
      const dataDir = o.dataDir ?? join(work, `data-${id}`);
      const backend = o.backend === 'qemu' ? ['--backend', 'qemu'] : ['--backend', 'unsafe-local', '--i-know-unsafe-local'];
      const args = ['--import', 'tsx', cli, 'serve', '--port', '0', '--tokens-file', tokensFile, '--data-dir', dataDir, ...backend, ...(o.args ?? [])];
      args.push('--catalog', redisUrl, '--broker-id', id, '--gateway-token-file', credentialFile, '--lease-ms', String(o.leaseMs ?? 1500), '--drain-ms', '20000');
      for (const t of o.templates ?? []) args.push('--advertise-template', t);
      args.push('--ready-json', '--log-level', 'warn');
      const p = start(process.execPath, args);
      procs.push(p);
      const ready = await firstJsonLine(p, `broker ${id}`);
      return Object.assign(p, { id, url: String(ready['url']), dataDir });
    },
    async startGateway(o = {}) {
      const args = ['--import', 'tsx', cli, 'gateway', '--port', '0', '--tokens-file', tokensFile, '--catalog', redisUrl, '--gateway-token-file', credentialFile];
      if (o.sample) args.push('--sample', String(o.sample));
      if (o.maxConnections) args.push('--max-connections', String(o.maxConnections));
      args.push(...(o.args ?? []), '--ready-json', '--log-level', 'warn');
      const p = start(process.execPath, args);
      procs.push(p);
      const ready = await firstJsonLine(p, 'gateway');
      return Object.assign(p, { url: String(ready['url']) });
    },
    async restartRedis() {
      redis.kill('SIGKILL');
      await redis.exited;
      redis = startRedis();
      procs.push(redis);
      self.redis = redis;
      await redisUp();
    },
    async stopAll() {
      catalog.close();
      for (const p of procs.reverse()) {
        if (p.p.exitCode !== null || p.p.signalCode !== null) continue;
        p.kill('SIGTERM');
        const t = setTimeout(() => p.kill('SIGKILL'), 10_000);
        await p.exited;
        clearTimeout(t);
      }
    },
  };
  return self;
}

/** Waits for a condition (not a timing assertion: the bound only turns a hang into a failure naming what was awaited). */
export async function until(what: string, check: () => boolean | Promise<boolean>, maxMs = 30_000): Promise<void> {
  const end = Date.now() + maxMs;
  while (!(await check())) {
    if (Date.now() > end) throw new Error(`waited ${maxMs} ms for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

/** The error a promise rejects with (failing the test if it resolves). */
export async function failure<E = Error>(p: Promise<unknown>): Promise<E> {
  try {
    await p;
  } catch (err) {
    return err as E;
  }
  throw new Error('expected a failure');
}
