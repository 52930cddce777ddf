import { mkdirSync } from 'node:fs';
import type { z } from 'zod';
import { HutchError } from '../../guest-agent/src/protocol/errors.ts';
import type { Logger } from '../../guest-agent/src/log.ts';
import { OPS, type OpName, type TelemetryEvent, type TelemetryParams } from './api/harness-protocol.ts';
import { WsServer, type OpContext } from './api/ws-server.ts';
import type { VmBackend } from './backends/backend.ts';
import { initRouter } from './router/index.ts';
import { SessionManager } from './sessions/session-manager.ts';
import type { FastPathRunner } from './tools/fastpath-runner.ts';
import { Admission, type AdmissionOptions } from './admission.ts';
import { BrokerMetrics } from './metrics.ts';
import { availableParallelism, totalmem } from 'node:os';
import { DEFAULT_POLICY, type SandboxPolicy } from './policy/sandbox-policy.ts';

export interface BrokerOptions {
  port: number;
  host?: string;
  token: string;
  dataDir: string;
  backend: VmBackend;
  fastPath: FastPathRunner;
  log: Logger;
  /** Largest file the file tools read or write (default 64 MiB). */
  maxFileBytes?: number;
  /** Release a session's VM after this long without a VM call (default 5 s); overrides policy.idleMs. */
  idleMs?: number;
  /** Routing, wake and release policy (default: level 4 with the cost model). */
  policy?: Partial<SandboxPolicy>;
  admission?: Partial<AdmissionOptions>;
}

/** A sample's deadline: generous, since an emulated (TCG) guest under load answers slowly. */
const TELEMETRY_TIMEOUT_MS = 5000;

function withTimeout<T>(p: Promise<T>, ms: number, fallback: T): Promise<T> {
  return new Promise((resolve, reject) => {
    const t = setTimeout(() => resolve(fallback), ms);
    p.then(
      (v) => {
        clearTimeout(t);
        resolve(v);
      },
      (e: unknown) => {
        clearTimeout(t);
        reject(e as Error);
      },
    );
  });
}

function sleepUnlessAborted(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const t = setTimeout(done, ms);
    function done(): void {
      clearTimeout(t);
      signal.removeEventListener('abort', done);
      resolve();
    }
    signal.addEventListener('abort', done, { once: true });
  });
}

/** Defaults sized to the host: wakes and VM calls by CPU count, memory by what the host has. */
export function defaultAdmission(): AdmissionOptions {
  const cpus = availableParallelism();
  return {
    maxConcurrentWakes: Math.max(1, cpus),
    maxConcurrentVmCalls: Math.max(2, cpus * 2),
    memoryBudgetMiB: Math.floor((totalmem() / 1024 / 1024) * 0.75),
    queueTimeoutMs: 120_000,
  };
}

function params<O extends OpName>(op: O, raw: unknown): z.infer<(typeof OPS)[O]> {
  const parsed = OPS[op].safeParse(raw);
  if (!parsed.success) {
    const i = parsed.error.issues[0];
    throw new HutchError('bad_request', `invalid ${op} params: ${i?.path.join('.') || '(params)'}: ${i?.message}`, { op });
  }
  return parsed.data as z.infer<(typeof OPS)[O]>;
}

/** The host daemon: sessions behind a WebSocket, calls routed per tool. */
export class Broker {
  readonly sessions: SessionManager;
  readonly metrics = new BrokerMetrics();
  readonly admission: Admission;
  readonly policy: SandboxPolicy;
  private server: WsServer | undefined;
  port = 0;

  constructor(private readonly opts: BrokerOptions) {
    mkdirSync(opts.dataDir, { recursive: true });
    this.policy = { ...DEFAULT_POLICY, ...opts.policy, ...(opts.idleMs !== undefined ? { idleMs: opts.idleMs } : {}) };
    this.admission = new Admission({ ...defaultAdmission(), ...opts.admission });
    this.sessions = new SessionManager(
      opts.dataDir,
      {
        backend: opts.backend,
        fastPath: opts.fastPath,
        admission: this.admission,
        metrics: this.metrics,
        log: opts.log,
        policy: this.policy,
        ...(opts.maxFileBytes ? { maxFileBytes: opts.maxFileBytes } : {}),
      },
      opts.log,
    );
  }

  async start(): Promise<number> {
    await initRouter();
    const adopted = this.sessions.loadExisting();
    this.server = new WsServer({
      port: this.opts.port,
      ...(this.opts.host ? { host: this.opts.host } : {}),
      token: this.opts.token,
      log: this.opts.log,
      hello: { backend: this.opts.backend.name, ...(this.opts.backend.accel ? { accel: this.opts.backend.accel } : {}) },
      handle: (op, p, ctx) => this.handle(op, p, ctx),
      http: (req, res) => {
        if (req.url === '/healthz') {
          res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify({ ok: true, sessions: this.sessions.list().length }));
          return true;
        }
        if (req.url === '/metrics') {
          this.metrics.sessions.set(this.sessions.list().length);
          this.metrics.admissionWaiting.set({ kind: 'wake' }, this.admission.wakes.waiting);
          this.metrics.admissionWaiting.set({ kind: 'vm_call' }, this.admission.vmCalls.waiting);
          return this.telemetry()
            .then((t) => this.metrics.setGuestGauges(t.sessions))
            .then(() => this.metrics.text())
            .then((text) => {
            res.writeHead(200, { 'content-type': this.metrics.contentType }).end(text);
            return true;
          });
        }
        return false;
      },
    });
    this.port = await this.server.listen();
    this.opts.log.info('broker.listening', { port: this.port, backend: this.opts.backend.name, isolation: this.opts.backend.isolation, policy: this.policy, adoptedSessions: adopted });
    return this.port;
  }

  async stop(): Promise<void> {
    await this.server?.close();
    await this.sessions.shutdown();
    await this.opts.backend.shutdown();
    await this.opts.fastPath.close?.();
    this.opts.log.info('broker.stopped');
  }

  /** Samples every live, awake VM (or one session's), each bounded by a timeout. */
  async telemetry(session?: string): Promise<TelemetryEvent> {
    const targets = session ? [this.sessions.get(session)] : this.sessions.all();
    const sessions = await Promise.all(
      targets.map((s) => withTimeout(s.telemetry(), TELEMETRY_TIMEOUT_MS, { session: s.id, vm: 'live' as const, error: `no sample within ${TELEMETRY_TIMEOUT_MS} ms` })),
    );
    return { atMs: Date.now(), sessions };
  }

  /** A live subscription: one event per interval until the client cancels it or `count` is reached. */
  private async subscribe(p: z.infer<typeof TelemetryParams>, ctx: OpContext): Promise<{ samples: number; cancelled: boolean }> {
    if (p.session) this.sessions.get(p.session); // unknown session: not_found now, not later
    const interval = p.intervalMs ?? 1000;
    let samples = 0;
    while (!ctx.signal.aborted && (p.count === undefined || samples < p.count)) {
      const started = Date.now();
      ctx.event(await this.telemetry(p.session));
      samples++;
      if (p.count !== undefined && samples >= p.count) break;
      await sleepUnlessAborted(Math.max(0, interval - (Date.now() - started)), ctx.signal);
    }
    return { samples, cancelled: ctx.signal.aborted };
  }

  private async handle(op: OpName, raw: unknown, ctx: OpContext): Promise<unknown> {
    switch (op) {
      case 'create': {
        const s = await this.sessions.create(params('create', raw));
        return s.info();
      }
      case 'attach':
        return this.sessions.get(params('attach', raw).session).info();
      case 'close': {
        const p = params('close', raw);
        return this.sessions.close(p.session, p.keepWorkspace ?? false);
      }
      case 'sessions':
        return { sessions: this.sessions.list() };
      case 'call': {
        const p = params('call', raw);
        const stream = p.stream ?? false;
        return this.sessions.get(p.session).call(p.tool, p.args, {
          signal: ctx.signal,
          ...(stream ? { onStdout: (c: Uint8Array) => ctx.out(1, c), onStderr: (c: Uint8Array) => ctx.out(2, c) } : {}),
        });
      }
      case 'hint': {
        const p = params('hint', raw);
        this.sessions.get(p.session).hint(p.hint);
        return { accepted: true };
      }
      case 'telemetry':
        return this.subscribe(params('telemetry', raw), ctx);
      case 'signal':
        throw new HutchError('internal', 'signal is handled by the transport');
    }
  }
}
