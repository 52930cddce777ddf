/**
 * jq filters are pure functions of their input, except for the few builtins that look at
 * the environment or load modules from disk. A filter naming any of them anywhere (even
 * inside a string, which errs on the safe side) is refused.
 */

const IMPURE: Record<string, string> = {
  env: 'reads the environment, which differs between the fast path and the VM',
  $ENV: 'reads the environment, which differs between the fast path and the VM',
  import: 'loads a module from disk',
  include: 'loads a module from disk',
  modulemeta: 'loads a module from disk',
  get_search_list: 'reads the module search path',
  $__prog_args: 'reads the program arguments',
};

export function analyseJqFilter(filter: string): string | null {
  // Identifiers, optionally `$`-prefixed; jq identifiers may contain `::`.
  for (const m of filter.matchAll(/\$?[A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*/g)) {
    const why = IMPURE[m[0]];
    if (why) return `jq filter uses \`${m[0]}\`, which ${why}`;
  }
  return null;
}
