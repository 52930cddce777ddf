import { readFileSync } from 'node:fs';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import { parseRules } from './egress-policy.ts';

/** Rules of an allowlist file (`hutch serve --egress-allowlist F`): one per line, `#` comments and blank lines ignored; each checked. */
export function readAllowlistFile(path: string): string[] {
  let text: string;
  try {
    text = readFileSync(path, 'utf8');
  } catch (err) {
    throw new HutchError('bad_request', `--egress-allowlist ${path}: ${(err as NodeJS.ErrnoException).code ?? (err as Error).message}`);
  }
  const rules = text
    .split('\n')
    .map((l) => l.replace(/#.*/, '').trim())
    .filter(Boolean);
  parseRules(rules, `--egress-allowlist ${path}`);
  return rules;
}
