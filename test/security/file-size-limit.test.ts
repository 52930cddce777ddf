import { afterAll, describe, expect, it } from 'vitest';
import { mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Workspace } from '../../guest-agent/src/workspace/confine.ts';
import { FileTools } from '../../guest-agent/src/workspace/file-tools.ts';

/**
 * Issue 12 item 5 (the file tools' part): every tool honours the file size limit. Before,
 * `edit` with replaceAll grew a file to 125 MB past the 64 MiB limit; now the result's size
 * is checked before anything is built or written.
 */

const dir = mkdtempSync(join(tmpdir(), 'hutch-filelimit-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
const codeOf = async (p: Promise<unknown>) => p.then(() => 'ok', (e: { code: string }) => e.code);

describe('the file size limit', () => {
  const tools = new FileTools(new Workspace(dir), { maxFileBytes: 1000 });

  it('edit refuses a replaceAll whose result is above it, and leaves the file as it was', async () => {
    const before = 'HEAD\n' + 'ab\n'.repeat(298); // 899 bytes, under the limit
    writeFileSync(join(dir, 'grow.txt'), before);
    const err = await tools.edit({ path: 'grow.txt', oldString: 'a', newString: 'aaaa', replaceAll: true }).catch((e) => e);
    expect(err).toMatchObject({ code: 'too_large', context: { path: 'grow.txt', limit: 1000, bytes: 1793 } });
    expect(readFileSync(join(dir, 'grow.txt'), 'utf8')).toBe(before);
    expect(readdirSync(dir).filter((n) => n.includes('.hutch-'))).toEqual([]);
    // A single replacement that stays under the limit still works.
    expect(await tools.edit({ path: 'grow.txt', oldString: 'HEAD', newString: 'H' })).toMatchObject({ replacements: 1 });
  });

  it('write, read and an edit of an oversized file refuse; grep skips it', async () => {
    expect(await codeOf(tools.write({ path: 'big.txt', content: 'x'.repeat(1001) }))).toBe('too_large');
    writeFileSync(join(dir, 'big.txt'), 'needle\n'.repeat(200));
    expect(await codeOf(tools.read({ path: 'big.txt' }))).toBe('too_large');
    expect(await codeOf(tools.edit({ path: 'big.txt', oldString: 'needle', newString: 'pin', replaceAll: true }))).toBe('too_large');
    writeFileSync(join(dir, 'small.txt'), 'needle\n');
    expect((await tools.grep({ pattern: 'needle' })).matches.map((m) => m.path)).toEqual(['small.txt']);
  });
});
