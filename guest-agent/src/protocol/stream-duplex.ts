import { Duplex } from 'node:stream';
import { HutchError, toHutchError } from './errors.ts';
import type { InboundStream, OutboundStream } from './flow-control.ts';

/**
 * A pair of protocol streams (one each way) as a Node Duplex, so a TCP connection tunnelled
 * over the agent channel can be piped like a socket: reading pulls from the inbound stream
 * only as fast as the consumer takes it (its credit goes back as it is read), writing
 * waits for the peer's credit. Ending the writable side ends the outbound stream; destroying
 * the duplex stops the inbound one and fails the outbound one, so the peer learns at once.
 */
export function streamDuplex(inbound: InboundStream, outbound: OutboundStream): Duplex {
  let pumping = false;
  const d = new Duplex({
    allowHalfOpen: true,
    read() {
      if (pumping) return;
      pumping = true;
      void pump();
    },
    write(chunk: Buffer, _enc, cb) {
      outbound.write(chunk).then(() => cb(), (err: unknown) => cb(toHutchError(err)));
    },
    final(cb) {
      outbound.end();
      cb();
    },
    destroy(err, cb) {
      inbound.stop();
      if (!outbound.ended) outbound.end(err ? toHutchError(err) : new HutchError('connection_closed', 'the tunnel was closed'));
      cb(err);
    },
  });
  async function pump(): Promise<void> {
    try {
      for (;;) {
        const c = await inbound.read();
        if (c === null) {
          d.push(null);
          return;
        }
        if (!d.push(c)) return;
      }
    } catch (err) {
      d.destroy(toHutchError(err));
    } finally {
      pumping = false;
    }
  }
  return d;
}
