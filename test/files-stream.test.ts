import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createHash, randomBytes } from 'node:crypto';
import { chownSync, createReadStream, existsSync, readdirSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import type { Hutch } from '../host-broker/src/sdk/index.ts';
import { startBroker, type TestBroker } from './helpers/broker.ts';

/**
 * Streamed uploads and downloads (host-broker/src/tools/file-stream.ts) through a real broker,
 * real WebSocket clients and real files: a file far above one frame goes in and out whole,
 * never more than the credit window unacknowledged either way, and an aborted upload leaves
 * no file and no temp file.
 */

const MiB = 1024 * 1024;
const wsOf = (b: TestBroker, id: string) => join(b.dataDir, 'sessions', id, 'workspace');
/** Names atomic-write.ts gives temp files. */
const temps = (dir: string) => readdirSync(dir).filter((n) => n.includes('.hutch-') && n.endsWith('.tmp'));

/** `total` random bytes in `piece`-byte pieces, hashed as they are made. */
async function* pattern(total: number, piece: number, hash?: ReturnType<typeof createHash>): AsyncGenerator<Buffer> {
  for (let made = 0; made < total; ) {
    const n = Math.min(piece, total - made);
    const buf = randomBytes(n);
    hash?.update(buf);
    made += n;
    yield buf;
  }
}

describe('streamed files', () => {
  let b: TestBroker;
  let hutch: Hutch;
  beforeAll(async () => {
    b = await startBroker({ quota: { bytes: 1024 * MiB, files: 10_000 } });
    hutch = await b.connect();
  }, 120_000);
  afterAll(async () => b?.stop());

  it('a 200 MiB file goes up and comes back whole (sha256), within the window both ways', async () => {
    const sb = await hutch.create({});
    const size = 200 * MiB;
    const sent = createHash('sha256');
    // Odd-sized pieces, so the SDK splits and joins them into chunks.
    const up = await sb.files.upload('data/big.bin', pattern(size, 300 * 1024 + 7, sent), { size });
    const digest = sent.digest('hex');
    expect(up).toMatchObject({ path: 'data/big.bin', bytes: size, created: true, sha256: digest });
    // Credit: the client never had more than the window in flight, nor the broker more than that unanswered.
    expect(up.clientPeakUnackedBytes).toBeGreaterThan(0);
    expect(up.clientPeakUnackedBytes).toBeLessThanOrEqual(up.window);
    expect(up.peakUnackedBytes).toBeLessThanOrEqual(up.window);
    expect(up.window).toBeLessThan(size / 4);
    const host = join(wsOf(b, sb.id), 'data', 'big.bin');
    expect(statSync(host).size).toBe(size);
    expect(createHash('sha256').update(readFileSync(host)).digest('hex')).toBe(digest);
    expect(temps(join(wsOf(b, sb.id), 'data'))).toEqual([]);

    // Download, consumed slowly at first: the broker may not run ahead of the acknowledgements.
    const got = createHash('sha256');
    let bytes = 0;
    let progressCalls = 0;
    const it = sb.files.download('data/big.bin', { onProgress: () => void progressCalls++ });
    let slow = 3;
    for await (const chunk of it) {
      got.update(chunk);
      bytes += chunk.length;
      if (slow-- > 0) await new Promise((r) => setTimeout(r, 200));
    }
    expect(bytes).toBe(size);
    expect(got.digest('hex')).toBe(digest);
    expect(progressCalls).toBeGreaterThan(100);
    await sb.close();
  }, 600_000);

  it('the broker sends a download no further than the client acknowledged', async () => {
    const sb = await hutch.create({});
    writeFileSync(join(wsOf(b, sb.id), 'f.bin'), Buffer.alloc(64 * MiB, 7));
    const window = hutch.hello.limits?.['streamWindowBytes'] as number;
    expect(window).toBeGreaterThan(0);
    // A raw request that never acknowledges: the events stop at one window.
    let received = 0;
    const ac = new AbortController();
    const done = hutch
      .request('download', { session: sb.id, path: 'f.bin' }, undefined, ac.signal, (d) => {
        const data = (d as { data?: Uint8Array }).data;
        if (data) received += data.length;
      })
      .catch((e: unknown) => e);
    let last = -1;
    while (received !== last) {
      last = received;
      await new Promise((r) => setTimeout(r, 300));
    }
    expect(received).toBeGreaterThan(0);
    expect(received).toBeLessThanOrEqual(window);
    ac.abort(); // cancel: the broker ends the call
    expect(await done).toMatchObject({ code: 'cancelled' });
    await sb.close();
  }, 120_000);

  it('an aborted upload (client abort, or a disconnect) leaves no file, no temp file and no directory it made', async () => {
    const sb = await hutch.create({});
    const ws = wsOf(b, sb.id);
    const ac = new AbortController();
    let acked = 0;
    const err = await sb.files
      .upload('made/deep/half.bin', pattern(64 * MiB, MiB), {
        signal: ac.signal,
        onProgress: (p) => {
          acked = p.acked;
          if (p.acked >= 8 * MiB) ac.abort();
        },
      })
      .catch((e: unknown) => e);
    expect(err).toMatchObject({ code: 'cancelled' });
    expect(acked).toBeGreaterThanOrEqual(8 * MiB);
    expect(existsSync(join(ws, 'made'))).toBe(false);
    expect(temps(ws)).toEqual([]);

    // A client that goes away mid-upload.
    const other = await b.connect();
    const sb2 = await other.attach(sb.id);
    const started = sb2.files.upload('gone.bin', pattern(64 * MiB, MiB), {
      onProgress: (p) => {
        if (p.acked >= 4 * MiB) other.close();
      },
    });
    expect(await started.catch((e: unknown) => e)).toMatchObject({ code: 'connection_closed' });
    const deadline = Date.now() + 10_000;
    while (temps(ws).length > 0 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50));
    expect(temps(ws)).toEqual([]);
    expect(existsSync(join(ws, 'gone.bin'))).toBe(false);
    // The session is fine, and a file a stream replaced keeps its content until a commit.
    writeFileSync(join(ws, 'keep.txt'), 'old\n');
    const ac2 = new AbortController();
    await sb.files.upload('keep.txt', pattern(4 * MiB, MiB), { signal: ac2.signal, onProgress: () => ac2.abort() }).catch(() => undefined);
    expect(readFileSync(join(ws, 'keep.txt'), 'utf8')).toBe('old\n');
    await sb.close();
  }, 120_000);

  it('uploads from a Readable and a Buffer, over JSON frames too (base64), replacing a file atomically', async () => {
    const json = await b.connect({ encoding: 'json' });
    const sb = await json.create({});
    const ws = wsOf(b, sb.id);
    const src = join(b.dataDir, 'src.bin');
    const content = Buffer.concat([...Array(3)].map((_, i) => Buffer.alloc(MiB + 123, i + 200)));
    writeFileSync(src, content);
    // No set-ID bits, ever (issue 12 item 3): refused, typed.
    expect(await sb.files.upload('r.bin', Buffer.from('x'), { mode: 0o4755 }).catch((e: unknown) => e)).toMatchObject({ code: 'bad_request' });
    const r = await sb.files.upload('r.bin', createReadStream(src), { mode: 0o750 });
    expect(r.bytes).toBe(content.length);
    expect(readFileSync(join(ws, 'r.bin')).equals(content)).toBe(true);
    expect(statSync(join(ws, 'r.bin')).mode & 0o7777).toBe(0o750);
    const asRoot = process.getuid?.() === 0;
    if (asRoot) chownSync(join(ws, 'r.bin'), 1234, 1234);
    const again = await sb.files.upload('r.bin', Buffer.from('small now'));
    expect(again).toMatchObject({ bytes: 9, created: false });
    // Replacing keeps the file's mode and owner, as the write tool does.
    expect(statSync(join(ws, 'r.bin')).mode & 0o7777).toBe(0o750);
    if (asRoot) expect([statSync(join(ws, 'r.bin')).uid, statSync(join(ws, 'r.bin')).gid]).toEqual([1234, 1234]);
    const chunks: Buffer[] = [];
    for await (const c of sb.files.download('r.bin')) chunks.push(c);
    expect(Buffer.concat(chunks).toString()).toBe('small now');
    // A file the in-process tools read sees the committed content.
    expect((await sb.files.read('r.bin')).content).toContain('small now');
    const empty = await sb.files.upload('empty.bin', Buffer.alloc(0));
    expect(empty.bytes).toBe(0);
    expect(statSync(join(ws, 'empty.bin')).size).toBe(0);
    await sb.close();
    json.close();
  }, 120_000);

  it("one connection's big transfer does not hold up another connection's calls", async () => {
    const sb = await hutch.create({ workspace: { files: { 'small.txt': 'hi\n' } } });
    const other = await b.connect();
    const sbOther = await other.attach(sb.id);
    const big = sb.files.upload('big2.bin', pattern(96 * MiB, MiB));
    let reads = 0;
    let finished = false;
    void big.finally(() => (finished = true));
    while (!finished) {
      expect((await sbOther.files.read('small.txt')).content).toContain('hi');
      reads++;
    }
    await big;
    // Reads were answered while the upload was going on, not only after it.
    expect(reads).toBeGreaterThan(3);
    other.close();
    await sb.close();
  }, 300_000);
});

describe('streamed upload into a session whose VM is awake', { tags: ['vm'] }, () => {
  let b: TestBroker;
  beforeAll(async () => {
    b = await startBroker({ backend: 'qemu', idleMs: 600_000 });
  }, 600_000);
  afterAll(async () => b?.stop());

  it('the next VM call sees the committed file (the host workspace is the source of truth)', async () => {
    const hutch = await b.connect();
    const sb = await hutch.create({ workspace: { files: { 'a.txt': 'a\n' } } });
    const woke = await sb.run('cat a.txt', { route: 'vm' });
    expect([woke.route, woke.stdout]).toEqual(['vm', 'a\n']);
    const sent = createHash('sha256');
    const up = await sb.files.upload('up/v.bin', pattern(3 * MiB + 5, MiB, sent));
    const r = await sb.run('sha256sum up/v.bin', { route: 'vm' });
    expect(r.route).toBe('vm');
    expect(r.woke).toBe(false); // the same VM, awake throughout
    expect(r.stdout.split(' ')[0]).toBe(up.sha256);
    expect(up.sha256).toBe(sent.digest('hex'));
    await sb.close();
  }, 600_000);
});
