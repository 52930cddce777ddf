/**
 * A minimal classic-BPF assembler for seccomp filters: the handful of instructions a
 * syscall filter needs, symbolic labels for forward jumps, and encoding into the kernel's
 * `struct sock_filter` array (u16 code, u8 jt, u8 jf, u32 k; little-endian on x86_64).
 *
 * Conditional jumps only ever skip 0 or 1 instructions here; anything farther goes through
 * `ja`, whose 32-bit offset has no reach problem. That keeps label resolution a single pass.
 */
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';

// Opcode parts from linux/bpf_common.h.
const BPF_LD = 0x00;
const BPF_JMP = 0x05;
const BPF_RET = 0x06;
const BPF_ALU = 0x04;
const BPF_W = 0x00;
const BPF_ABS = 0x20;
const BPF_K = 0x00;
const BPF_JA = 0x00;
const BPF_JEQ = 0x10;
const BPF_JGT = 0x20;
const BPF_JGE = 0x30;
const BPF_JSET = 0x40;
const BPF_AND = 0x50;

/** The kernel refuses longer programs (BPF_MAXINSNS). */
export const BPF_MAXINSNS = 4096;

export interface Insn {
  code: number;
  jt: number;
  jf: number;
  k: number;
  /** For `ja`: the label it goes to, resolved by {@link Program.assemble}. */
  target?: string;
}

export type Cond = 'eq' | 'gt' | 'ge' | 'set';
const COND_OP: Record<Cond, number> = { eq: BPF_JEQ, gt: BPF_JGT, ge: BPF_JGE, set: BPF_JSET };

export class Program {
  private readonly insns: Insn[] = [];
  private readonly labels = new Map<string, number>();
  private nextLabel = 0;

  get length(): number {
    return this.insns.length;
  }

  /** A fresh label name, placed later with {@link label}. */
  newLabel(hint = 'L'): string {
    return `${hint}${this.nextLabel++}`;
  }

  label(name: string): this {
    if (this.labels.has(name)) throw new HutchError('internal', `bpf: label ${name} placed twice`);
    this.labels.set(name, this.insns.length);
    return this;
  }

  /** A <- u32 at byte offset `off` of struct seccomp_data. */
  loadAbs(off: number): this {
    return this.push({ code: BPF_LD | BPF_W | BPF_ABS, jt: 0, jf: 0, k: off });
  }

  andK(k: number): this {
    return this.push({ code: BPF_ALU | BPF_AND | BPF_K, jt: 0, jf: 0, k: k >>> 0 });
  }

  /** if (A <cond> k) skip `jt` instructions else skip `jf` (each 0..255). */
  jump(cond: Cond, k: number, jt: number, jf: number): this {
    if (jt < 0 || jt > 255 || jf < 0 || jf > 255) throw new HutchError('internal', `bpf: jump offset out of range (${jt}, ${jf})`);
    return this.push({ code: BPF_JMP | COND_OP[cond] | BPF_K, jt, jf, k: k >>> 0 });
  }

  /** Unconditional jump to a label placed later. */
  ja(target: string): this {
    return this.push({ code: BPF_JMP | BPF_JA, jt: 0, jf: 0, k: 0, target });
  }

  ret(k: number): this {
    return this.push({ code: BPF_RET | BPF_K, jt: 0, jf: 0, k: k >>> 0 });
  }

  /** Resolves labels and encodes the program as struct sock_filter[]. */
  assemble(): Buffer {
    if (this.insns.length === 0 || this.insns.length > BPF_MAXINSNS) {
      throw new HutchError('internal', `bpf: program length ${this.insns.length} outside 1..${BPF_MAXINSNS}`);
    }
    const last = this.insns[this.insns.length - 1] as Insn;
    if ((last.code & 0x07) !== BPF_RET) throw new HutchError('internal', 'bpf: program must end with ret');
    const buf = Buffer.alloc(this.insns.length * 8);
    this.insns.forEach((insn, pc) => {
      let k = insn.k;
      if (insn.target !== undefined) {
        const to = this.labels.get(insn.target);
        if (to === undefined) throw new HutchError('internal', `bpf: label ${insn.target} never placed`);
        if (to <= pc) throw new HutchError('internal', `bpf: backward jump to ${insn.target}`);
        k = to - pc - 1;
      }
      const isJump = (insn.code & 0x07) === BPF_JMP;
      const reach = insn.target !== undefined ? k : Math.max(insn.jt, insn.jf);
      if (isJump && pc + 1 + reach >= this.insns.length) throw new HutchError('internal', `bpf: jump past end at ${pc}`);
      buf.writeUInt16LE(insn.code, pc * 8);
      buf.writeUInt8(insn.jt, pc * 8 + 2);
      buf.writeUInt8(insn.jf, pc * 8 + 3);
      buf.writeUInt32LE(k, pc * 8 + 4);
    });
    return buf;
  }

  private push(insn: Insn): this {
    this.insns.push(insn);
    return this;
  }
}

/** Decodes struct sock_filter[] back to instructions (tests, debugging). */
export function decode(buf: Uint8Array): Insn[] {
  const b = Buffer.from(buf.buffer, buf.byteOffset, buf.byteLength);
  const out: Insn[] = [];
  for (let off = 0; off + 8 <= b.length; off += 8) {
    out.push({ code: b.readUInt16LE(off), jt: b.readUInt8(off + 2), jf: b.readUInt8(off + 3), k: b.readUInt32LE(off + 4) });
  }
  return out;
}

/**
 * Runs a seccomp BPF program on one syscall, as the kernel would, for the filter's unit
 * tests and for describe(). Only the instructions {@link Program} emits are understood.
 */
export function evaluate(prog: readonly Insn[], data: { nr: number; arch: number; args?: readonly number[] }): number {
  const word = (off: number): number => {
    if (off === 0) return data.nr >>> 0;
    if (off === 4) return data.arch >>> 0;
    if (off >= 16 && off < 64) {
      const i = Math.floor((off - 16) / 8);
      const v = BigInt.asUintN(64, BigInt(data.args?.[i] ?? 0));
      return Number((off - 16) % 8 === 0 ? v & 0xffffffffn : v >> 32n);
    }
    throw new HutchError('internal', `bpf: unsupported load offset ${off}`);
  };
  let a = 0;
  for (let pc = 0; pc < prog.length; ) {
    const i = prog[pc] as Insn;
    const cls = i.code & 0x07;
    if (cls === BPF_RET) return i.k >>> 0;
    if (cls === BPF_LD) {
      a = word(i.k);
      pc++;
    } else if (cls === BPF_ALU) {
      a = (a & i.k) >>> 0;
      pc++;
    } else {
      const op = i.code & 0xf0;
      if (op === BPF_JA) {
        pc += 1 + i.k;
        continue;
      }
      const k = i.k >>> 0;
      const hit = op === BPF_JEQ ? a === k : op === BPF_JGT ? a > k : op === BPF_JGE ? a >= k : (a & k) !== 0;
      pc += 1 + (hit ? i.jt : i.jf);
    }
  }
  throw new HutchError('internal', 'bpf: fell off the end of the program');
}
