/**
 * One sandbox's network as the broker keeps it: its egress policy (changeable while the
 * sandbox lives: the next connection is decided by the new one), its proxied connections
 * (bounded in number and in bytes per second), and what passed (bytes each way, refusals),
 * for each call's result, the session's telemetry and /metrics.
 */
import { EventEmitter } from 'node:events';
import type { Duplex } from 'node:stream';
import type { RangeSet } from './addresses.ts';
import { describePolicy, type EgressPolicy } from './egress-policy.ts';
import { answerRefusal, serveProxyConnection, type ProxyEvent } from './proxy-connection.ts';
import { RateLimiter } from './rate-limiter.ts';

export interface NetworkCounters {
  bytesIn: number;
  bytesOut: number;
  connections: number;
  refused: number;
}

export interface NetworkLimits {
  /** Proxied connections one sandbox holds at once. */
  maxConnections: number;
  /** Bytes per second, both directions together, over all of one sandbox's connections. */
  bytesPerSecond: number;
}

export const DEFAULT_NETWORK_LIMITS: NetworkLimits = { maxConnections: 64, bytesPerSecond: 32 * 1024 * 1024 };

/** What one principal's sandboxes hold together: a tenant with many sandboxes cannot take every socket. */
export class PrincipalConnections {
  private readonly held = new Map<string, number>();
  constructor(readonly perPrincipal: number) {}

  take(principal: string): boolean {
    const n = this.held.get(principal) ?? 0;
    if (n >= this.perPrincipal) return false;
    this.held.set(principal, n + 1);
    return true;
  }

  give(principal: string): void {
    const n = (this.held.get(principal) ?? 1) - 1;
    if (n <= 0) this.held.delete(principal);
    else this.held.set(principal, n);
  }
}

export interface SandboxNetworkOptions {
  session: string;
  principal: string;
  policy: EgressPolicy;
  own: () => RangeSet;
  limits: NetworkLimits;
  principalConnections: PrincipalConnections;
  /** Broker-wide: each allowed, refused and failed connection (metrics, logs). */
  onEvent?: (e: ProxyEvent & { session: string; principal: string }) => void;
  /** Broker-wide: bytes as they pass (metrics). */
  onBytes?: (principal: string, bytesIn: number, bytesOut: number) => void;
  /** Tests: the name resolution and connect the proxy uses. */
  proxy?: Pick<Parameters<typeof serveProxyConnection>[1], 'lookup' | 'connect' | 'headTimeoutMs' | 'idleTimeoutMs'>;
}

export class SandboxNetwork extends EventEmitter {
  private policyNow: EgressPolicy;
  private readonly rate: RateLimiter;
  private open = 0;
  /** Since the session's creation (this broker process). */
  readonly totals: NetworkCounters = { bytesIn: 0, bytesOut: 0, connections: 0, refused: 0 };

  constructor(private readonly o: SandboxNetworkOptions) {
    super();
    this.policyNow = o.policy;
    this.rate = new RateLimiter(o.limits.bytesPerSecond);
  }

  get policy(): EgressPolicy {
    return this.policyNow;
  }

  /** A new policy for the next connections (connections already open keep going). */
  setPolicy(p: EgressPolicy): void {
    this.policyNow = p;
  }

  describe(): ReturnType<typeof describePolicy> {
    return describePolicy(this.policyNow);
  }

  get openConnections(): number {
    return this.open;
  }

  /** A copy of the counters, to take a call's share as the difference after it. */
  snapshot(): NetworkCounters {
    return { ...this.totals };
  }

  /** Serves one tenant connection (a tunnel from the guest's proxy port) to its end; with the bytes it carried. */
  async serve(tunnel: Duplex): Promise<ProxyEvent & { bytesIn: number; bytesOut: number }> {
    const refuse = (why: string) => {
      answerRefusal(tunnel, 429, why);
      const e: ProxyEvent = { outcome: 'refused', host: '', port: 0, reason: why, status: 429 };
      this.note(e);
      return { ...e, bytesIn: 0, bytesOut: 0 };
    };
    if (this.open >= this.o.limits.maxConnections) return refuse(`this sandbox already has ${this.open} connections open (at most ${this.o.limits.maxConnections})`);
    if (!this.o.principalConnections.take(this.o.principal)) return refuse(`this principal's sandboxes already hold ${this.o.principalConnections.perPrincipal} connections`);
    this.open++;
    let bytesIn = 0;
    let bytesOut = 0;
    try {
      const e = await serveProxyConnection(tunnel, {
        ...this.o.proxy,
        policy: () => this.policyNow,
        own: this.o.own,
        rate: this.rate,
        onEvent: (e) => this.note(e),
        onBytes: (i, out) => {
          bytesIn += i;
          bytesOut += out;
          this.totals.bytesIn += i;
          this.totals.bytesOut += out;
          this.o.onBytes?.(this.o.principal, i, out);
        },
      });
      return { ...e, bytesIn, bytesOut };
    } finally {
      this.open--;
      this.o.principalConnections.give(this.o.principal);
    }
  }

  private note(e: ProxyEvent): void {
    if (e.outcome === 'allowed') this.totals.connections++;
    else if (e.outcome === 'refused') this.totals.refused++;
    this.o.onEvent?.({ ...e, session: this.o.session, principal: this.o.principal });
    if (e.outcome === 'refused') this.emit('refused', e);
  }
}
