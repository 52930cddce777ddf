/**
 * Where a new session goes: sample K live brokers that can serve its template, ask each for
 * its load (GET /load with the gateway credential), take the least loaded. Sampling a few
 * instead of asking all keeps a placement O(K) however large the cluster, and the
 * randomness spreads concurrent placements from many gateways instead of herding them onto
 * the one broker that looked emptiest a moment ago ("power of K choices").
 */
import { request, Agent } from 'node:http';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { BrokerRecord } from '../catalog/catalog.ts';
import type { BrokerLoad } from '../catalog/member.ts';

/** Lower is better. Queues and refusals mean the host is saturated now; sessions and live VMs are what it already carries. */
export function score(l: BrokerLoad, memoryMiB: number): number {
  let s = l.wakeQueue * 4 + l.vmCallQueue + l.admissionRefusals * 8 + l.liveVms * 2 + l.sessions * 0.25;
  // A host that could not wake this session's VM now: only if nothing better exists.
  if (l.budgetFreeMiB < memoryMiB || (l.memAvailableMiB > 0 && l.memAvailableMiB < memoryMiB)) s += 1000;
  return s;
}

export function sample<T>(items: readonly T[], k: number, rnd: () => number = Math.random): T[] {
  const a = [...items];
  for (let i = a.length - 1; i > 0; i--) {
    const j = Math.floor(rnd() * (i + 1));
    [a[i], a[j]] = [a[j] as T, a[i] as T];
  }
  return a.slice(0, k);
}

export function httpUrlOf(wsUrl: string): string {
  return wsUrl.replace(/^ws(s?):\/\//, 'http$1://');
}

const agent = new Agent({ keepAlive: true, maxSockets: 8 });

export function fetchLoad(rec: BrokerRecord, credential: string, timeoutMs: number): Promise<BrokerLoad> {
  return new Promise((resolve, reject) => {
    const req = request(`${httpUrlOf(rec.url)}/load`, { agent, headers: { authorization: `Bearer ${credential}` }, timeout: timeoutMs }, (res) => {
      const chunks: Buffer[] = [];
      let size = 0;
      res.on('data', (c: Buffer) => {
        size += c.length;
        if (size > 64 * 1024) req.destroy(new Error('load answer too large'));
        else chunks.push(c);
      });
      res.on('end', () => {
        if (res.statusCode !== 200) return reject(new Error(`HTTP ${res.statusCode}`));
        try {
          resolve(JSON.parse(Buffer.concat(chunks).toString('utf8')) as BrokerLoad);
        } catch (err) {
          reject(err as Error);
        }
      });
    });
    req.on('timeout', () => req.destroy(new Error(`no load within ${timeoutMs} ms`)));
    req.on('error', reject);
    req.end();
  });
}

export interface Placement {
  broker: BrokerRecord;
  load: BrokerLoad;
  /** The brokers sampled and their scores (for logs and tests). */
  considered: Array<{ broker: string; score: number | null }>;
}

/**
 * Picks a broker among `live` for a session needing `template` (if any) and `memoryMiB`.
 * A sampled broker that does not answer is skipped; if none of the sample answers, the rest
 * are tried in a second sample before giving up with `unavailable`.
 */
export async function place(
  live: readonly BrokerRecord[],
  o: { template?: string | undefined; memoryMiB: number; k: number; credential: string; timeoutMs: number; rnd?: () => number },
): Promise<Placement> {
  const able = o.template === undefined ? [...live] : live.filter((b) => b.templates.includes(o.template as string));
  if (able.length === 0) {
    throw new HutchError('unavailable', o.template === undefined ? 'no live broker to place a session on' : `no live broker advertises template ${o.template}`, {
      ...(o.template !== undefined ? { template: o.template } : {}),
      brokers: live.length,
    });
  }
  let pool = sample(able, able.length, o.rnd);
  const considered: Placement['considered'] = [];
  while (pool.length) {
    const batch = pool.slice(0, Math.max(1, o.k));
    pool = pool.slice(batch.length);
    const loads = await Promise.all(batch.map((b) => fetchLoad(b, o.credential, o.timeoutMs).then((l) => ({ b, l }), () => ({ b, l: undefined }))));
    let best: { b: BrokerRecord; l: BrokerLoad; s: number } | undefined;
    for (const { b, l } of loads) {
      const s = l ? score(l, o.memoryMiB) : null;
      considered.push({ broker: b.id, score: s });
      if (l && s !== null && (!best || s < best.s)) best = { b, l, s };
    }
    if (best) return { broker: best.b, load: best.l, considered };
  }
  throw new HutchError('unavailable', `no broker answered for its load (${considered.map((c) => c.broker).join(', ')})`, { brokers: considered.map((c) => c.broker) });
}
