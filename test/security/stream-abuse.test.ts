import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { execFileSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, rmSync, symlinkSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Hutch } from '../../host-broker/src/sdk/index.ts';
import { startBroker, type TestBroker } from '../helpers/broker.ts';

/**
 * Issue 12 item 7 (large files through a streamed upload/download with flow control): what
 * a tenant holding a token would try against the stream ops, with raw requests where the
 * SDK would behave. Every refusal is typed, nothing lands outside the workspace, and no
 * temp file outlives a stream that did not commit.
 */

const MiB = 1024 * 1024;
const wsOf = (b: TestBroker, id: string) => join(b.dataDir, 'sessions', id, 'workspace');
const temps = (dir: string) => readdirSync(dir).filter((n) => n.includes('.hutch-') && n.endsWith('.tmp'));
const BOB = 'bob-token-' + randomBytes(6).toString('hex');
const IDLE_MS = 1500;
const MAX_STREAMS = 16;
const fail = (p: Promise<unknown>) => p.then(() => 'resolved', (e: unknown) => e);
const settle = (p: Promise<unknown>) => p.then((r) => r, (e: unknown) => e);
/** Below one chunk (1 MiB), so one chunk can be past it. */
const WINDOW = 512 * 1024;

async function until(check: () => boolean, ms = 10_000): Promise<boolean> {
  const deadline = Date.now() + ms;
  while (!check() && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50));
  return check();
}

describe('streamed files: what a tenant would try', () => {
  let b: TestBroker;
  let hutch: Hutch;
  let outside: string;
  beforeAll(async () => {
    b = await startBroker({ tokens: { bob: BOB }, limits: { streamWindowBytes: WINDOW, streamIdleMs: IDLE_MS, maxStreamsPerConnection: MAX_STREAMS, maxStreamedFileBytes: 48 * MiB } });
    hutch = await b.connect();
    outside = mkdtempSync(join(tmpdir(), 'hutch-stream-outside-'));
  }, 120_000);
  afterAll(async () => {
    await b?.stop();
    if (outside) rmSync(outside, { recursive: true, force: true });
  });

  it('path escapes (.., absolute, symlinked directory, final symlink) are refused both ways', async () => {
    const sb = await hutch.create({ workspace: { files: { 'a.txt': 'a\n' } } });
    const ws = wsOf(b, sb.id);
    symlinkSync(outside, join(ws, 'out-dir'));
    symlinkSync('/etc/passwd', join(ws, 'passwd-link'));
    symlinkSync('/proc/self/environ', join(ws, 'environ-link'));
    for (const path of ['../escape.bin', '/etc/hutch-escape.bin', '/work/../escape.bin', 'out-dir/x.bin', 'passwd-link']) {
      const e = await fail(sb.files.upload(path, Buffer.from('pwned')));
      expect(e, path).toMatchObject({ code: expect.stringMatching(/^(outside_workspace|bad_request)$/) });
    }
    expect(readdirSync(outside)).toEqual([]);
    expect(existsSync('/etc/hutch-escape.bin')).toBe(false);
    for (const path of ['../../../../etc/passwd', '/etc/passwd', 'out-dir/../a.txt/../../x', 'passwd-link', 'environ-link', '/proc/self/environ']) {
      const e = await fail((async () => { for await (const _ of sb.files.download(path)) throw new Error(`read ${path}`); })());
      expect(e, path).toMatchObject({ code: expect.stringMatching(/^(outside_workspace|not_found|bad_request)$/) });
    }
    expect(temps(ws)).toEqual([]);
    await sb.close();
  }, 60_000);

  it('a FIFO, a device node or a directory is never read or written, and nothing blocks', async () => {
    const sb = await hutch.create({});
    const ws = wsOf(b, sb.id);
    execFileSync('mkfifo', [join(ws, 'fifo')]);
    mkdirSync(join(ws, 'dir'));
    let device = false;
    try {
      execFileSync('mknod', [join(ws, 'null-dev'), 'c', '1', '3'], { stdio: 'ignore' });
      device = true;
    } catch {
      console.log('stream-abuse: mknod refused (not root): the device-node case is left out');
    }
    for (const path of ['fifo', ...(device ? ['null-dev'] : [])]) {
      const e = await fail((async () => { for await (const _ of sb.files.download(path)) throw new Error(`read ${path}`); })());
      expect(e, path).toMatchObject({ code: 'unsupported_file_type' });
      expect(await fail(sb.files.upload(path, Buffer.from('x'))), path).toMatchObject({ code: 'bad_request' });
    }
    expect(await fail((async () => { for await (const _ of sb.files.download('dir')) break; })())).toMatchObject({ code: 'is_a_directory' });
    expect(await fail(sb.files.upload('dir', Buffer.from('x')))).toMatchObject({ code: 'is_a_directory' });
    expect(temps(ws)).toEqual([]);
    await sb.close();
  }, 60_000);

  it('the quota stops an upload mid-stream; the size limit refuses up front and mid-stream', async () => {
    // 4 MiB there already, so the quota (8 MiB) is reached before the size limit (the quota too).
    const sb = await hutch.create({ quota: { bytes: 8 * MiB }, workspace: { files: { 'fill.bin': Buffer.alloc(4 * MiB, 1) } } });
    const ws = wsOf(b, sb.id);
    let acked = 0;
    const e = await fail(sb.files.upload('big.bin', (async function* () { for (let i = 0; i < 32; i++) yield randomBytes(MiB); })(), { onProgress: (p) => void (acked = p.acked) }));
    expect(e).toMatchObject({ code: 'quota_exceeded', context: { limit: 'bytes', quota: 8 * MiB } });
    expect(acked).toBeGreaterThan(0); // it got going before it was stopped
    expect(acked).toBeLessThanOrEqual(4 * MiB);
    expect(existsSync(join(ws, 'big.bin'))).toBe(false);
    expect(temps(ws)).toEqual([]);
    // Announced too big: refused before a byte moves (limit: the quota, below the broker's 48 MiB).
    expect(await fail(hutch.request('upload', { session: sb.id, path: 'x.bin', size: 9 * MiB }))).toMatchObject({ code: 'too_large', context: { limit: 8 * MiB } });
    const big = await hutch.create({ quota: { bytes: 512 * MiB } });
    expect(await fail(hutch.request('upload', { session: big.id, path: 'x.bin', size: 49 * MiB }))).toMatchObject({ code: 'too_large', context: { limit: 48 * MiB } });
    // Unannounced: cut where it passes the limit.
    const cut = await fail(big.files.upload('y.bin', (async function* () { for (let i = 0; i < 60; i++) yield Buffer.alloc(MiB); })()));
    expect(cut).toMatchObject({ code: 'too_large' });
    expect(temps(wsOf(b, big.id))).toEqual([]);
    expect(existsSync(join(wsOf(b, big.id), 'y.bin'))).toBe(false);
    await sb.close();
    await big.close();
  }, 120_000);

  it('chunks past the window, out of order or oversized end the stream typed, and leave nothing', async () => {
    const sb = await hutch.create({});
    const ws = wsOf(b, sb.id);
    const open = (await hutch.request('upload', { session: sb.id, path: 'w.bin' })) as { stream: string; window: number; chunkBytes: number };
    expect(open.window).toBe(WINDOW);
    // A burst without waiting for answers, its last chunk alone past the window.
    const answers = await Promise.all([
      settle(hutch.request('uploadChunk', { session: sb.id, stream: open.stream, offset: 0, data: Buffer.alloc(WINDOW / 2, 1) })),
      settle(hutch.request('uploadChunk', { session: sb.id, stream: open.stream, offset: WINDOW / 2, data: Buffer.alloc(WINDOW + 1, 1) })),
    ]);
    expect(answers[1]).toMatchObject({ code: 'flow_control' });
    expect(await fail(hutch.request('uploadCommit', { session: sb.id, stream: open.stream }))).toMatchObject({ code: 'not_found' });
    expect(await until(() => temps(ws).length === 0)).toBe(true);
    expect(existsSync(join(ws, 'w.bin'))).toBe(false);

    const o2 = (await hutch.request('upload', { session: sb.id, path: 'w2.bin' })) as { stream: string };
    expect(await fail(hutch.request('uploadChunk', { session: sb.id, stream: o2.stream, offset: 5, data: Buffer.from('x') }))).toMatchObject({ code: 'bad_request' });
    const o3 = (await hutch.request('upload', { session: sb.id, path: 'w3.bin' })) as { stream: string };
    expect(await fail(hutch.request('uploadChunk', { session: sb.id, stream: o3.stream, offset: 0, data: Buffer.alloc(MiB + 1) }))).toMatchObject({ code: 'bad_request' });
    expect(await until(() => temps(ws).length === 0)).toBe(true);
    // A download acknowledged past what was sent.
    await sb.files.upload('d.bin', Buffer.alloc(3 * MiB, 2)); // six windows
    let stream = '';
    const dl = fail(hutch.request('download', { session: sb.id, path: 'd.bin' }, undefined, undefined, (d) => void (stream ||= (d as { stream?: string }).stream ?? '')));
    expect(await until(() => stream !== '')).toBe(true);
    expect(await fail(hutch.request('downloadAck', { session: sb.id, stream, bytes: 64 * MiB }))).toMatchObject({ code: 'flow_control' });
    expect(await dl).toMatchObject({ code: 'flow_control' }); // and that ended the download
    await sb.close();
  }, 60_000);

  it("another principal's, connection's or session's stream id answers not_found, and the stream is untouched", async () => {
    const sb = await hutch.create({});
    const mine2 = await hutch.create({});
    const ws = wsOf(b, sb.id);
    const open = (await hutch.request('upload', { session: sb.id, path: 'victim.bin' })) as { stream: string };
    await hutch.request('uploadChunk', { session: sb.id, stream: open.stream, offset: 0, data: Buffer.from('good ') });
    const bob = await Hutch.connect(b.url, { token: BOB });
    const bobSb = await bob.create({});
    const sameOwnerOtherConn = await b.connect();
    const attempts = [
      bob.request('uploadChunk', { session: bobSb.id, stream: open.stream, offset: 5, data: Buffer.from('evil') }),
      bob.request('uploadChunk', { session: sb.id, stream: open.stream, offset: 5, data: Buffer.from('evil') }),
      bob.request('uploadCommit', { session: bobSb.id, stream: open.stream }),
      bob.request('uploadAbort', { session: bobSb.id, stream: open.stream }),
      sameOwnerOtherConn.request('uploadChunk', { session: sb.id, stream: open.stream, offset: 5, data: Buffer.from('evil') }),
      sameOwnerOtherConn.request('uploadAbort', { session: sb.id, stream: open.stream }),
      hutch.request('uploadChunk', { session: mine2.id, stream: open.stream, offset: 5, data: Buffer.from('evil') }),
      hutch.request('uploadCommit', { session: mine2.id, stream: open.stream }),
      hutch.request('uploadChunk', { session: sb.id, stream: 'AAAAAAAAAAAAAAAA', offset: 0, data: Buffer.from('x') }),
    ];
    for (const a of attempts) expect(await fail(a)).toMatchObject({ code: 'not_found' });
    // Bob cannot download from the session either.
    expect(await fail(bob.request('download', { session: sb.id, path: 'victim.bin' }))).toMatchObject({ code: 'not_found' });
    await hutch.request('uploadChunk', { session: sb.id, stream: open.stream, offset: 5, data: Buffer.from('data') });
    expect(await hutch.request('uploadCommit', { session: sb.id, stream: open.stream })).toMatchObject({ bytes: 9 });
    const got: Buffer[] = [];
    for await (const c of sb.files.download('victim.bin')) got.push(c);
    expect(Buffer.concat(got).toString()).toBe('good data');
    expect(temps(ws)).toEqual([]);
    bob.close();
    sameOwnerOtherConn.close();
    await sb.close();
    await mine2.close();
  }, 60_000);

  it('an upload never committed times out and its temp file is removed', async () => {
    const sb = await hutch.create({});
    const ws = wsOf(b, sb.id);
    const open = (await hutch.request('upload', { session: sb.id, path: 'idle/never.bin' })) as { stream: string };
    await hutch.request('uploadChunk', { session: sb.id, stream: open.stream, offset: 0, data: Buffer.alloc(4096, 1) });
    expect(temps(join(ws, 'idle'))).toHaveLength(1);
    expect(await until(() => !existsSync(join(ws, 'idle')), IDLE_MS * 10)).toBe(true);
    expect(await fail(hutch.request('uploadChunk', { session: sb.id, stream: open.stream, offset: 4096, data: Buffer.from('late') }))).toMatchObject({ code: 'not_found' });
    expect(temps(ws)).toEqual([]);
    await sb.close();
  }, 60_000);

  it('thousands of parallel opens: a bounded number per connection, the rest busy, and all cleaned up', async () => {
    const sb = await hutch.create({});
    const ws = wsOf(b, sb.id);
    const answers = await Promise.all(Array.from({ length: 2000 }, (_, i) => settle(hutch.request('upload', { session: sb.id, path: `p/${i}.bin` }))));
    const opened = answers.filter((a) => typeof (a as { stream?: unknown }).stream === 'string') as Array<{ stream: string }>;
    const busy = answers.filter((a) => (a as { code?: string }).code === 'busy');
    expect(opened.length).toBe(MAX_STREAMS);
    expect(busy.length).toBe(2000 - MAX_STREAMS);
    expect(temps(join(ws, 'p')).length).toBeLessThanOrEqual(MAX_STREAMS);
    // Another connection of the same principal still gets its own streams and calls.
    const other = await b.connect();
    const otherSb = await other.attach(sb.id);
    expect((await otherSb.files.upload('p/other.bin', Buffer.from('fine'))).bytes).toBe(4);
    // Aborted, or already dropped as idle (not_found): either way, gone.
    for (const o of opened) await hutch.request('uploadAbort', { session: sb.id, stream: o.stream }).catch((e: unknown) => expect(e).toMatchObject({ code: 'not_found' }));
    expect(readdirSync(join(ws, 'p'))).toEqual(['other.bin']);
    // The slots came back.
    expect((await sb.files.upload('p/after.bin', Buffer.from('ok'))).bytes).toBe(2);
    other.close();
    await sb.close();
  }, 120_000);
});
