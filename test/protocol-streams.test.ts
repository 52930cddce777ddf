import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createHash, randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { startAgent, type AgentProcess } from './helpers/agent-process.ts';

const MiB = 1024 * 1024;

function vmHWM(pid: number): number {
  const m = /VmHWM:\s+(\d+) kB/.exec(readFileSync(`/proc/${pid}/status`, 'utf8'));
  return Number(m?.[1] ?? 0) * 1024;
}

describe('streams over one connection', () => {
  let agent: AgentProcess;
  beforeAll(async () => {
    agent = await startAgent();
  });
  afterAll(async () => agent.stop());

  it('64 concurrent echo streams each get their own bytes back intact', async () => {
    const results = await Promise.all(
      Array.from({ length: 64 }, async (_, i) => {
        const data = randomBytes(64 * 1024 + i * 997);
        const back: Uint8Array[] = [];
        await agent.client.echo(
          (async function* () {
            for (let o = 0; o < data.length; o += 7000) yield data.subarray(o, o + 7000);
          })(),
          (c) => void back.push(c),
        );
        return createHash('sha256').update(Buffer.concat(back)).digest('hex') === createHash('sha256').update(data).digest('hex');
      }),
    );
    expect(results.filter(Boolean).length).toBe(64);
  });

  it('a stalled stream does not block a small call on the same connection', async () => {
    // stdout nobody reads quickly: the agent's writer stalls on credit, but ping still answers.
    let release!: () => void;
    const gate = new Promise<void>((r) => (release = r));
    let first = true;
    const h = agent.client.exec({
      command: 'head -c 50000000 /dev/zero',
      onStdout: async () => {
        if (first) {
          first = false;
          await gate;
        }
      },
    });
    const t = await agent.client.call('ping', {});
    expect(t.now).toBeGreaterThan(0);
    const st = await agent.client.call('fs.list', {});
    expect(st.path).toBe('.');
    release();
    const r = await h.result;
    expect(r.stdout.bytes).toBe(50_000_000);
  });

  it('1 GiB through one stream with a slow receiver keeps both sides bounded', async () => {
    const conn = agent.client.connection;
    const window = conn.inboundWindow;
    const rssBefore = process.memoryUsage().rss;
    let received = 0;
    let maxBuffered = 0;
    let n = 0;
    const h = agent.client.exec({
      command: 'head -c 1073741824 /dev/zero',
      maxOutputBytes: 2 * 1024 * MiB,
      onStdout: async (c) => {
        received += c.length;
        maxBuffered = Math.max(maxBuffered, conn.stats().bufferedBytes);
        // A slow consumer: yield to the event loop every few chunks.
        if (++n % 16 === 0) await new Promise((r) => setImmediate(r));
      },
    });
    const r = await h.result;
    expect(r.exitCode).toBe(0);
    expect(received).toBe(1024 * MiB);
    expect(r.stdout).toEqual({ bytes: 1024 * MiB, kept: 1024 * MiB, truncated: false });
    // Receiver: everything buffered for the connection stays within one window plus one frame.
    expect(maxBuffered).toBeLessThanOrEqual(window + 1024 * 1024);
    // And the processes themselves did not grow with the bytes moved (1 GiB went through).
    expect(process.memoryUsage().rss - rssBefore).toBeLessThan(128 * MiB);
    expect(vmHWM(agent.proc.pid as number)).toBeLessThan(256 * MiB);
  });
});
