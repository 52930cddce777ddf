/**
 * What an operator reads: one log line per request (a failure at warn with its request id,
 * principal, session, route and error code; a success at debug), /healthz for liveness
 * only and /readyz for whether new work should come (not while starting, draining, or
 * with the guest image gone), and hutch_build_info on /metrics.
 */
import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, rmSync, unlinkSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join, relative } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { createLogger } from '../guest-agent/src/log.ts';
import { cacheRoot } from '../build/cache.ts';
import { startBroker, type TestBroker } from './helpers/broker.ts';

const work = mkdtempSync(join(tmpdir(), 'hutch-ops-'));
afterAll(() => rmSync(work, { recursive: true, force: true }));

type Line = Record<string, unknown> & { level: string; msg: string };

async function http(b: TestBroker, path: string): Promise<{ status: number; body: Record<string, unknown> }> {
  const r = await fetch(`${b.url.replace('ws:', 'http:')}${path}`);
  return { status: r.status, body: (await r.json()) as Record<string, unknown> };
}

describe('logs, health and build info', () => {
  it('a failed call is logged once at warn with request id, principal, session, route and code; a success at debug', async () => {
    const lines: Line[] = [];
    const log = createLogger({ name: 'hutch-broker', level: 'debug', write: (l) => lines.push(JSON.parse(l) as Line) });
    const b = await startBroker({ log });
    try {
      const h = await b.connect();
      const sb = await h.create({ workspace: { files: { 'a.txt': 'A\n' } } });
      await sb.files.read('a.txt');
      await expect(sb.files.read('missing.txt')).rejects.toMatchObject({ code: 'not_found' });
      await expect(sb.run('cat missing.txt', { route: 'fastpath' })).resolves.toMatchObject({ exitCode: 1 });
      await expect(h.attach('no-such-session')).rejects.toMatchObject({ code: 'not_found' });
      const failed = lines.filter((l) => l.msg === 'op.failed');
      expect(failed).toHaveLength(2);
      expect(failed[0]).toMatchObject({ level: 'warn', op: 'call', principal: 'default', session: sb.id, route: 'inprocess', code: 'not_found' });
      expect(failed[1]).toMatchObject({ level: 'warn', op: 'attach', principal: 'default', session: 'no-such-session', code: 'not_found' });
      expect(failed[0]?.['req']).toMatch(/^\d+:\d+$/);
      expect(failed[0]?.['req']).not.toBe(failed[1]?.['req']);
      // Successes: debug only, each with its route when it is a call.
      const done = lines.filter((l) => l.msg === 'op.done');
      expect(done.every((l) => l.level === 'debug')).toBe(true);
      expect(done.filter((l) => l.op === 'call').map((l) => l['route'])).toEqual(['inprocess', 'fastpath']);
      // Nothing else about those requests at info or above.
      expect(lines.filter((l) => l.level !== 'debug' && /^(call|op)\./.test(l.msg)).map((l) => l.msg)).toEqual(['op.failed', 'op.failed']);
    } finally {
      await b.stop();
    }
  });

  it('/healthz is liveness only; /readyz is false while starting and draining; /metrics has hutch_build_info', async () => {
    const b = await startBroker();
    try {
      expect(await http(b, '/healthz')).toEqual({ status: 200, body: { ok: true } });
      expect(await http(b, '/readyz')).toEqual({ status: 200, body: { ready: true } });
      const metrics = await (await fetch(`${b.url.replace('ws:', 'http:')}/metrics`, { headers: { authorization: `Bearer ${b.token}` } })).text();
      expect(metrics).toMatch(/^hutch_build_info\{version="\d+\.\d+\.\d+[^"]*",backend="unsafe-local",accel="none"\} 1$/m);
      await b.broker.drain(1000);
      expect(await http(b, '/readyz')).toEqual({ status: 503, body: { ready: false, reason: 'draining' } });
      expect((await http(b, '/healthz')).status).toBe(200);
    } finally {
      await b.stop();
    }
    // Before start() has finished the broker says it is starting (start() is where it begins to listen).
    const { Broker } = await import('../host-broker/src/broker.ts');
    const { createBackend } = await import('../host-broker/src/backends/registry.ts');
    const { createFastPath } = await import('../host-broker/src/tools/fastpath-factory.ts');
    const log = createLogger({ name: 't', level: 'warn' });
    const fastPath = await createFastPath(log);
    const dataDir = mkdtempSync(join(work, 'data-'));
    const backend = await createBackend('unsafe-local', { log, dataDir, fastPath, acknowledgeUnsafeLocal: true });
    const broker = new Broker({ port: 0, token: 'starting-token-0123456789', dataDir, backend, fastPath, log });
    expect(broker.notReady()).toBe('starting');
    await broker.start();
    expect(broker.notReady()).toBeUndefined();
    await broker.stop();
  });
});

describe('/readyz with the guest image gone (qemu backend, no VM booted)', { tags: ['vm'] }, () => {
  it('is ready with the image in the cache, not ready once a part of it is removed; no KVM is a warning saying what it costs', async (ctx) => {
    const { ensureGuestImage } = await import('../host-broker/src/vm/guest-image.ts');
    // The cached image, never built here: a machine without it skips (./hutch setup builds it).
    const image = await ensureGuestImage({ noBuild: true, log: () => undefined }).catch(() => undefined);
    if (!image) return ctx.skip();
    // A cache of hard links to its parts' directories: removing a file takes nothing from the real cache.
    const cache = join(work, 'cache');
    const real = cacheRoot();
    const { baseHash } = await import('../rootfs/base.ts');
    // Each part's directory, and the Debian base the agent layer and the root are made from.
    const dirs = [image.kernel, image.initrd, image.agentLayer, image.rootfs].flatMap((f) => (f ? [dirname(f)] : []));
    for (const from of [...dirs, join(real, 'rootfs-base', await baseHash())]) {
      const to = join(cache, relative(real, from));
      if (existsSync(to)) continue;
      mkdirSync(dirname(to), { recursive: true });
      execFileSync('cp', ['-al', from, to]);
    }
    const saved = process.env['HUTCH_CACHE'];
    process.env['HUTCH_CACHE'] = cache;
    let b: TestBroker | undefined;
    try {
      // The copy must be found whole: never build (debootstrap, a kernel) into it.
      await ensureGuestImage({ noBuild: true, log: () => undefined });
      const lines: Line[] = [];
      b = await startBroker({ backend: 'qemu', standby: 0, log: createLogger({ name: 'hutch-broker', level: 'info', write: (l) => lines.push(JSON.parse(l) as Line) }) });
      expect(await http(b, '/readyz')).toEqual({ status: 200, body: { ready: true } });
      const tcg = lines.filter((l) => l.msg === 'accel.tcg');
      if (b.backend.accel === 'tcg') {
        expect(tcg).toHaveLength(1);
        expect(tcg[0]).toMatchObject({ level: 'warn' });
        expect(String(tcg[0]?.['text'])).toMatch(/emulates every guest instruction.*ls -l \/dev\/kvm/);
        expect(JSON.stringify(lines)).not.toMatch(/EAX=|RIP=/);
      } else expect(tcg).toEqual([]);
      const rootfs = join(cache, relative(real, image.rootfs));
      expect(existsSync(rootfs)).toBe(true);
      unlinkSync(rootfs);
      const r = await http(b, '/readyz');
      expect(r.status).toBe(503);
      expect(String(r.body['reason'])).toMatch(/root filesystem is missing from the cache/);
      // The reason names no host path (/readyz needs no token).
      expect(String(r.body['reason'])).not.toContain(cache);
    } finally {
      await b?.stop();
      if (saved === undefined) delete process.env['HUTCH_CACHE'];
      else process.env['HUTCH_CACHE'] = saved;
    }
  }, 300_000);
});
