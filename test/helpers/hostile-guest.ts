import { mkdtempSync, rmSync } from 'node:fs';
import { createServer, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Connection } from '../../guest-agent/src/protocol/connection.ts';
import { FRAME_HEADER_BYTES } from '../../guest-agent/src/protocol/frame-codec.ts';
import { AgentClient } from '../../host-broker/src/agent-client.ts';
import { GUEST_FRAME_SHAPE_LIMITS } from '../../guest-agent/src/protocol/value-shape.ts';
import type { Logger } from '../../guest-agent/src/log.ts';

/**
 * A guest agent that is no longer ours (a tenant with root in the guest), for the tests and
 * the bench of what its frames may cost the broker. Getting root in a real guest is not
 * something a test can do, so the guest is a real agent Connection (it answers the broker's
 * hello, so the session is genuine) on a Unix socket that the flood also writes raw frames
 * to. The broker side is the real AgentClient.
 */

/**
 * A `res` frame answering request 999,999 (which nobody sent: dropped, not counted as a
 * protocol error) whose result is one array filling about 1 MiB:
 * - `empty-maps`: empty msgpack maps, ~180 ms of decoding here, the costliest content per
 *   byte we found, refused unread by the broker's shape check for guest frames;
 * - `within-limits`: the costliest frame that check lets through: as many timestamps
 *   (an extension decoded to a Date, ~350 ns each) as it allows objects, then fixints.
 */
export type HostileFrameKind = 'empty-maps' | 'within-limits';

export function hostileFrame(epoch: number, kind: HostileFrameKind = 'empty-maps', bytes = 1024 * 1024 - 64): Buffer {
  const head = Buffer.from([0x84, 0xa1, 0x74, 0xa3, 0x72, 0x65, 0x73, 0xa2, 0x69, 0x64, 0xce, 0, 0x0f, 0x42, 0x3f, 0xa2, 0x65, 0x70, 0xce, 0, 0, 0, 0, 0xa1, 0x72]);
  head.writeUInt32BE(epoch >>> 0, 19);
  const room = bytes - head.length - 5;
  const items: Buffer[] = [];
  let count = 0;
  if (kind === 'empty-maps') {
    items.push(Buffer.alloc(room, 0x80));
    count = room;
  } else {
    const limits = GUEST_FRAME_SHAPE_LIMITS;
    // The envelope's map and the array are objects too; its 8 keys and values, and the array, are values.
    const stamps = Math.min((limits.maxObjects as number) - 2, Math.floor(room / 6));
    const stamp = Buffer.from([0xd6, 0xff, 0x65, 0x00, 0x00, 0x00]);
    items.push(Buffer.concat(Array.from({ length: stamps }, () => stamp)));
    const ints = Math.min(limits.maxValues - 10 - stamps, room - stamps * 6);
    items.push(Buffer.alloc(ints, 0x01));
    count = stamps + ints;
  }
  const arrayHead = Buffer.from([0xdd, 0, 0, 0, 0]);
  arrayHead.writeUInt32BE(count, 1);
  const body = Buffer.concat([head, arrayHead, ...items]);
  const frame = Buffer.allocUnsafe(FRAME_HEADER_BYTES + body.length);
  frame.writeUInt32BE(body.length, 0);
  body.copy(frame, FRAME_HEADER_BYTES);
  return frame;
}

export interface GuestPair {
  /** The broker's side. */
  client: AgentClient;
  /** The guest's side of the socket, where raw frames go. */
  agentSocket: Socket;
  close(): void;
}

/**
 * An agent (answering `ping`) and the broker's client of it; `guarded: false` is the
 * previous code (AgentClient's guestGuards off).
 */
export async function guestPair(opts: { guarded: boolean; log?: Logger }): Promise<GuestPair> {
  const dir = mkdtempSync(join(tmpdir(), 'hutch-flood-'));
  const path = join(dir, 'agent.sock');
  let agentSocket: Socket | undefined;
  const server = createServer((s) => {
    agentSocket = s;
    new Connection(s, { role: 'agent', handlers: { ping: async () => ({ now: Date.now(), uptimeMs: 1 }) } });
  });
  await new Promise<void>((r) => server.listen(path, r));
  const client = await AgentClient.connectUnix(path, { guestGuards: opts.guarded, ...(opts.log ? { log: opts.log } : {}) });
  await client.connection.ready;
  return {
    client,
    agentSocket: agentSocket as Socket,
    close: () => {
      client.close();
      agentSocket?.destroy();
      server.close();
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

/** Writes hostile frames as fast as the broker takes them, until stopped. */
export function flood(g: GuestPair, kind: HostileFrameKind = 'empty-maps'): { stop(): void; written(): number } {
  const epoch = (g.client.connection.peer as { ep: number }).ep;
  const frame = hostileFrame(epoch, kind);
  let stopped = false;
  let written = 0;
  const pump = () => {
    while (!stopped && !g.agentSocket.destroyed) {
      written++;
      if (!g.agentSocket.write(frame)) {
        g.agentSocket.once('drain', pump);
        return;
      }
    }
  };
  pump();
  return { stop: () => void (stopped = true), written: () => written };
}
