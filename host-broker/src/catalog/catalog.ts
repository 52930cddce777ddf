/**
 * The cluster catalog in Redis: which brokers are alive (a lease each) and which broker
 * owns each session. Gateways are stateless; everything they must agree on lives here.
 *
 * Keys (prefix `hutch:` by default):
 *   <p>broker:<id>    JSON BrokerRecord, with a TTL (the lease); the broker renews it
 *   <p>brokers        SET of broker ids ever registered (expired ones are pruned lazily)
 *   <p>session:<principal>:<sid>
 *                     JSON SessionEntry {broker, principal}; no TTL (a session outlives restarts).
 *                     Keyed by principal: one principal's session id is never looked up, claimed
 *                     or re-published as another's (principal names and ids hold no ':').
 *
 * Why Redis and not etcd: the catalog needs a key TTL (a lease), SET NX for first-writer-wins
 * placement and one compare-and-delete; Redis has all three as single commands (or a three-line
 * Lua script), Debian ships redis-server 7.0 in bookworm, and a client is a page of code.
 * etcd would bring Raft (good for a multi-node catalog) at the cost of gRPC and a far larger
 * client; Redis with a replica (or a managed one) is enough for a map that brokers can rebuild.
 */
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { AttachParams } from '../api/harness-protocol.ts';
import { parseRedisUrl, RespClient, type RespValue } from './resp.ts';

export interface BrokerRecord {
  id: string;
  /** ws:// address gateways reach this broker's harness API at. */
  url: string;
  /** Templates this broker can create sessions from (a create naming one is placed only here). */
  templates: string[];
  startedAt: string;
}

export interface SessionEntry {
  broker: string;
  principal: string;
}

/** Delete a key only while it still holds the value we wrote (a session placed by us, not a later one). */
const COMPARE_AND_DELETE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end";

const BROKER_ID = /^[A-Za-z0-9_.-]{1,128}$/;

export function checkBrokerId(id: string): string {
  if (!BROKER_ID.test(id)) throw new HutchError('bad_request', `broker id ${JSON.stringify(id)}: use 1-128 letters, digits, '.', '_' or '-'`);
  return id;
}

/**
 * A session id as the protocol defines it, checked before it becomes a catalog key: a tenant
 * cannot make a gateway or Redis handle a key of megabytes or of another shape.
 */
export function sessionIdOf(v: unknown): string {
  const r = AttachParams.shape.session.safeParse(v);
  if (!r.success) throw new HutchError('bad_request', `invalid session: ${r.error.issues[0]?.message}`);
  return r.data;
}

export class Catalog {
  private readonly redis: RespClient;

  constructor(
    url: string,
    private readonly prefix = 'hutch:',
    timeoutMs = 2000,
  ) {
    this.redis = new RespClient(parseRedisUrl(url), timeoutMs);
  }

  close(): void {
    this.redis.close();
  }

  private brokerKey(id: string): string {
    return `${this.prefix}broker:${id}`;
  }

  private sessionKey(principal: string, sid: string): string {
    return `${this.prefix}session:${principal}:${sid}`;
  }

  /**
   * Writes (or renews) a broker's record with a TTL of `leaseMs`. True when the record was
   * not there before (a first registration, a lapsed lease, or a catalog that lost its data).
   */
  async putBroker(rec: BrokerRecord, leaseMs: number): Promise<boolean> {
    const before = await this.redis.command('SET', this.brokerKey(rec.id), JSON.stringify(rec), 'PX', Math.max(1, Math.round(leaseMs)), 'GET');
    // Every renewal re-adds the id: a lazy prune by a gateway between our SET and a read cannot hide us for long.
    await this.redis.command('SADD', `${this.prefix}brokers`, rec.id);
    return before === null;
  }

  /** Removes a broker at once (a drain), rather than waiting for its lease to run out. */
  async removeBroker(id: string): Promise<void> {
    await this.redis.command('DEL', this.brokerKey(id));
    await this.redis.command('SREM', `${this.prefix}brokers`, id);
  }

  /** Brokers whose lease is current. */
  async liveBrokers(): Promise<BrokerRecord[]> {
    const ids = strings(await this.redis.command('SMEMBERS', `${this.prefix}brokers`));
    if (ids.length === 0) return [];
    const vals = await this.redis.command('MGET', ...ids.map((id) => this.brokerKey(id)));
    const out: BrokerRecord[] = [];
    const expired: string[] = [];
    (Array.isArray(vals) ? vals : []).forEach((v, i) => {
      if (typeof v === 'string') {
        try {
          out.push(JSON.parse(v) as BrokerRecord);
          return;
        } catch {
          // a record we cannot read counts as absent
        }
      }
      expired.push(ids[i] as string);
    });
    if (expired.length) await this.redis.command('SREM', `${this.prefix}brokers`, ...expired).catch(() => undefined);
    return out;
  }

  /**
   * Claims a session id of the entry's principal for a broker: SET NX, so of two placing the
   * same id at the same moment exactly one wins. False when the id is taken.
   */
  async claimSession(sid: string, entry: SessionEntry): Promise<boolean> {
    return (await this.redis.command('SET', this.sessionKey(entry.principal, sid), JSON.stringify(entry), 'NX')) === 'OK';
  }

  /** A principal's session: another principal's with the same id is not looked at. */
  async session(principal: string, sid: string): Promise<SessionEntry | undefined> {
    const v = await this.redis.command('GET', this.sessionKey(principal, sid));
    if (typeof v !== 'string') return undefined;
    try {
      const entry = JSON.parse(v) as SessionEntry;
      return entry.principal === principal ? entry : undefined;
    } catch {
      return undefined;
    }
  }

  /** Forgets a session, but only the placement we made (compare-and-delete). */
  async releaseSession(sid: string, entry: SessionEntry): Promise<boolean> {
    return (await this.redis.command('EVAL', COMPARE_AND_DELETE, 1, this.sessionKey(entry.principal, sid), JSON.stringify(entry))) === 1;
  }
}

function strings(v: RespValue): string[] {
  return Array.isArray(v) ? v.filter((x): x is string => typeof x === 'string') : [];
}
