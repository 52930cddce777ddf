import { createHash } from 'node:crypto';
import { lstatSync, readdirSync, readFileSync, readlinkSync } from 'node:fs';

/**
 * A digest of a directory tree as the sync sees it: every entry's raw name bytes, kind,
 * permission bits, file content and symlink target. Names matching `skip` (the pull's
 * staging dir) are left out. Two trees with the same digest hold the same workspace.
 */
export function treeDigest(root: string, skip: (name: Buffer) => boolean = () => false): string {
  const h = createHash('sha256');
  const visit = (dir: Buffer, rel: Buffer) => {
    const names = (readdirSync(dir, { encoding: 'buffer' }) as Buffer[]).filter((n) => !skip(n)).sort(Buffer.compare);
    for (const n of names) {
      const abs = Buffer.concat([dir, Buffer.from('/'), n]);
      const r = rel.length ? Buffer.concat([rel, Buffer.from('/'), n]) : n;
      const st = lstatSync(abs);
      h.update(r).update('\0').update(String(st.mode & 0o177777)).update('\0');
      if (st.isFile()) h.update(readFileSync(abs));
      else if (st.isSymbolicLink()) h.update(readlinkSync(abs, { encoding: 'buffer' }));
      h.update('\0');
      if (st.isDirectory()) visit(abs, r);
    }
  };
  visit(Buffer.from(root), Buffer.alloc(0));
  return h.digest('hex');
}

/** Number of entries below root (files, dirs, links), raw names. */
export function countEntries(root: string): number {
  let n = 0;
  const visit = (dir: Buffer) => {
    for (const name of readdirSync(dir, { encoding: 'buffer' }) as Buffer[]) {
      n++;
      const abs = Buffer.concat([dir, Buffer.from('/'), name]);
      if (lstatSync(abs).isDirectory()) visit(abs);
    }
  };
  visit(Buffer.from(root));
  return n;
}
