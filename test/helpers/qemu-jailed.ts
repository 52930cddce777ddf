import { readFileSync, readlinkSync } from 'node:fs';
import { DEFAULT_VM_UID_BASE } from '../../host-broker/src/vm/qemu-jail.ts';

/** Fields of /proc/<pid>/status. */
export function processStatus(pid: number): Record<string, string> {
  const out: Record<string, string> = {};
  for (const line of readFileSync(`/proc/${pid}/status`, 'utf8').split('\n')) {
    const i = line.indexOf(':');
    if (i > 0) out[line.slice(0, i)] = line.slice(i + 1).trim();
  }
  return out;
}

/** What a tenant who escaped into this QEMU would hold: its ids, capabilities, filters, namespaces and network. */
export interface QemuJailView {
  uids: number[];
  gids: number[];
  capEff: string;
  capPrm: string;
  noNewPrivs: string;
  seccomp: string;
  ownPidNamespace: boolean;
  ownNetNamespace: boolean;
  /** Network interfaces it sees (its namespace's /proc/<pid>/net/dev). */
  interfaces: string[];
}

export function qemuJailView(pid: number): QemuJailView {
  const s = processStatus(pid);
  const ns = (kind: string) => readlinkSync(`/proc/${pid}/ns/${kind}`) !== readlinkSync(`/proc/self/ns/${kind}`);
  const interfaces = readFileSync(`/proc/${pid}/net/dev`, 'utf8').split('\n').slice(2).map((l) => l.split(':')[0]?.trim() ?? '').filter(Boolean);
  return {
    uids: (s['Uid'] ?? '').split(/\s+/).map(Number),
    gids: (s['Gid'] ?? '').split(/\s+/).map(Number),
    capEff: s['CapEff'] ?? '',
    capPrm: s['CapPrm'] ?? '',
    noNewPrivs: s['NoNewPrivs'] ?? '',
    seccomp: s['Seccomp'] ?? '',
    ownPidNamespace: ns('pid'),
    ownNetNamespace: ns('net'),
    interfaces,
  };
}

/** The jail as qemu-jail.ts promises it, field by field (a failing expect names the field). */
export const JAILED = {
  capEff: '0000000000000000',
  capPrm: '0000000000000000',
  noNewPrivs: '1',
  seccomp: '2',
  ownPidNamespace: true,
  ownNetNamespace: true,
  interfaces: ['lo'],
};

export function isVmUid(ids: number[]): boolean {
  return ids.length > 0 && ids.every((u) => u >= DEFAULT_VM_UID_BASE);
}
