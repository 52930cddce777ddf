import { execFileSync } from 'node:child_process';

/** Why a root-only VM test cannot run here (not root, or a tool missing), or undefined when it can. */
export function missingRootTools(tools: readonly string[], rootWhy: string): string | undefined {
  if (process.getuid?.() !== 0) return rootWhy;
  for (const tool of tools) {
    try {
      execFileSync('sh', ['-c', 'command -v "$1"', 'sh', tool], { stdio: 'ignore' });
    } catch {
      return `${tool} is not installed`;
    }
  }
  return undefined;
}
