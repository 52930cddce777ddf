import type { Duplex } from 'node:stream';
import { Connection, type Handlers } from './protocol/connection.ts';
import { HutchError } from './protocol/errors.ts';
import type { Capabilities } from './protocol/messages.ts';
import type { ResultOf } from './protocol/methods.ts';
import type { Logger } from './log.ts';
import { ExecService, type ExecConfig } from './process/exec-handler.ts';
import { Workspace } from './workspace/confine.ts';
import { FileTools } from './workspace/file-tools.ts';
import { WorkspaceSync } from './workspace/sync.ts';
import { resumeAfterRestore, startResumeHelper } from './resume.ts';
import { guestState } from './guest-state.ts';
import { memoryHandlers } from './memory/handlers.ts';
import { telemetryHandlers } from './telemetry/handlers.ts';
import { withCallUsage } from './telemetry/call-usage.ts';
import { GuestNetwork } from './net/tunnels.ts';

export interface AgentOptions {
  /** Workspace root on this machine (/work in the guest). */
  root: string;
  mountPoint?: string;
  exec: ExecConfig;
  /** Owner of files the agent creates in the workspace (the tenant user). */
  owner?: { uid: number; gid: number } | undefined;
  caps?: Capabilities;
  maxFrameBytes?: number;
  windowBytes?: number;
  /** The agent owns its machine (runs in a VM): it may set the clock after a restore. */
  ownsMachine?: boolean;
  /** The overlay's upper directory: writes outside /work and /tmp land there. */
  overlayUpper?: string | undefined;
  /** cgroup v2 directory tenant commands run in. */
  workloadCgroup?: string | undefined;
  log: Logger;
}

/** The agent's services, shared by every connection it accepts. */
export class Agent {
  readonly ws: Workspace;
  readonly files: FileTools;
  readonly sync: WorkspaceSync;
  readonly execs: ExecService;
  /** Tunnels for the sandbox's network (net.*); its proxy port listens only in a VM (listenNetwork). */
  readonly net: GuestNetwork;
  private readonly startedAt = Date.now();

  constructor(private readonly opts: AgentOptions) {
    this.ws = new Workspace(opts.root, opts.mountPoint);
    this.files = new FileTools(this.ws, opts.owner ? { owner: opts.owner } : {});
    this.sync = new WorkspaceSync(this.ws, { owner: opts.owner });
    this.execs = new ExecService(this.ws, { ...opts.exec, ...(opts.workloadCgroup ? { cgroup: opts.workloadCgroup } : {}) });
    this.net = new GuestNetwork(opts.log);
    // Started now, so the pristine snapshot holds it waiting: a resume then forks nothing.
    if (opts.ownsMachine) startResumeHelper(opts.log);
  }

  handlers(): Handlers {
    const f = this.files;
    return {
      ping: async () => ({ now: Date.now(), uptimeMs: Date.now() - this.startedAt }),
      // In a VM the agent owns the machine, so guest-wide vmstat deltas are the call's.
      exec: this.opts.ownsMachine ? withCallUsage(this.execs.exec) : this.execs.exec,
      'exec.signal': this.execs.signal,
      'fs.read': (p) => f.read(p),
      'fs.write': (p) => f.write(p),
      'fs.edit': (p) => f.edit(p),
      'fs.glob': (p) => f.glob(p),
      'fs.grep': (p) => f.grep(p),
      'fs.list': (p) => f.list(p),
      'fs.stat': (p) => f.stat(p),
      'fs.mkdir': (p) => f.mkdir(p),
      'fs.remove': (p) => f.remove(p),
      'fs.move': (p) => f.move(p),
      'sync.apply': (p, ctx) =>
        this.sync.apply(
          p.changes,
          (c) => {
            if (c.data) return c.data;
            if (c.stream !== undefined) return ctx.inbound(c.stream);
            return new Uint8Array(0);
          },
          { fresh: p.fresh ?? false, mark: p.mark ?? false, since: p.since },
        ),
      'sync.mark': () => this.sync.mark(),
      'sync.changes': async (p, ctx) => {
        // The change set goes on the stream in records, with the stream's flow control.
        const out = ctx.outbound(p.stream);
        const r = await this.sync.changes(p.since, { inlineMaxBytes: p.inlineMaxBytes ?? 64 * 1024, maxFileBytes: p.maxFileBytes }, out);
        out.end();
        await out.flushed();
        return p.state ? { ...r, state: await this.state(p.state.maxPaths) } : r;
      },
      'sync.read': async (p, ctx) => {
        const out = ctx.outbound(p.stream);
        const f = await this.sync.openFile(p.path);
        let bytes = 0;
        try {
          for await (const c of f.stream) {
            bytes += c.length;
            await out.write(c);
          }
        } finally {
          await f.close();
        }
        out.end();
        await out.flushed();
        return { bytes };
      },
      'agent.resume': (p) => resumeAfterRestore(p, this.opts.ownsMachine ?? false, (done) => this.execs.holdUntil(done)),
      'agent.detach': async (_p, ctx) => {
        // Answer first, then let go of the channel: the port is reopened and the agent waits
        // for the next broker with no session of its own, so a snapshot taken now restores
        // the same way whoever was attached when it was taken.
        setTimeout(() => ctx.connection.close('detached by the broker'), 20).unref();
        return { detached: true };
      },
      'debug.exit': async (p) => {
        // Fault injection for the soak bench: the agent process dies as if it crashed.
        setTimeout(() => process.exit(p.code ?? 70), 20);
        return { exiting: true };
      },
      'agent.state': (p) => this.state(p.maxPaths),
      'debug.echo': async (p, ctx) => {
        const input = ctx.inbound(p.input);
        const output = ctx.outbound(p.output);
        let bytes = 0;
        for await (const c of input) {
          bytes += c.length;
          await output.write(c);
        }
        output.end();
        await output.flushed();
        return { bytes };
      },
      'net.dial': this.net.dial,
      ...memoryHandlers({ workloadCgroup: this.opts.workloadCgroup, execs: this.execs, log: this.opts.log }),
      ...telemetryHandlers({ workloadCgroup: this.opts.workloadCgroup, execs: this.execs }),
    };
  }

  /** What the tenant left outside the workspace and what still runs (agent.state, and after a pull's scan). */
  private state(maxPaths = 50): Promise<ResultOf<'agent.state'>> {
    return guestState({ overlayUpper: this.opts.overlayUpper, workloadCgroup: this.opts.workloadCgroup, maxPaths });
  }

  /**
   * Serves one connection (a Unix socket client, or the broker on a virtio-serial port).
   * `channel: true` is for a long-lived device channel: the broker speaks first and may
   * start over with a new hello (after a snapshot restore it is a different broker process).
   */
  serve(socket: Duplex, opts: { channel?: boolean } = {}): Connection {
    const conn = new Connection(socket, {
      ...(opts.channel ? { channel: true } : {}),
      role: 'agent',
      handlers: this.handlers(),
      caps: { ...this.opts.caps, pid: process.pid, mountPoint: this.ws.mountPoint },
      ...(this.opts.maxFrameBytes !== undefined ? { maxFrameBytes: this.opts.maxFrameBytes } : {}),
      ...(this.opts.windowBytes !== undefined ? { windowBytes: this.opts.windowBytes } : {}),
      log: this.opts.log,
    });
    conn.on('ready', () => {
      this.net.attach(conn);
      this.opts.log.info('agent.connection_ready');
      conn.emitEvent('ready', { pid: process.pid });
    });
    conn.on('close', (err: HutchError) => this.opts.log.info('agent.connection_closed', { reason: err.message }));
    return conn;
  }
}
