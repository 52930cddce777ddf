import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startBroker, type TestBroker } from '../helpers/broker.ts';
import type { Sandbox } from '../../host-broker/src/sdk/index.ts';

/**
 * Issue 38 item 6: the route depended on how a variable was given. `LC_MESSAGES=/work/loc`
 * and `LANGUAGE=../../../../work/loc` in the call's `env` ran on the fast path (so glibc
 * and gettext there loaded locale data and message catalogs the tenant wrote), while the
 * same assignments written inline went to the VM; `TZ=/work/x` in the env stayed on the
 * fast path too. Now one check decides both forms: per variable family, the call's env and
 * the inline prefix must take the same route, and a value that names a file (or a variable
 * that loads code or data) must take the VM.
 */
const FAMILIES: Record<string, { vm: Array<[string, string]>; fastpath?: Array<[string, string]> }> = {
  locale: {
    vm: [['LC_MESSAGES', '/work/loc'], ['LANGUAGE', '../../../../work/loc'], ['LC_ALL', '/work/loc'], ['LANG', './loc'], ['LC_ADDRESS', '/work/loc'], ['LC_MONETARY', 'x/y']],
    fastpath: [['LC_ALL', 'C'], ['LANG', 'C.UTF-8'], ['LANGUAGE', 'de:fr'], ['LC_PAPER', 'C']],
  },
  TZ: { vm: [['TZ', '/work/x'], ['TZ', ':/work/x'], ['TZ', '../../../work/x'], ['TZ', ':UTC']], fastpath: [['TZ', 'UTC'], ['TZ', 'Europe/Paris'], ['TZ', 'EST5EDT']] },
  GCONV_PATH: { vm: [['GCONV_PATH', '/work/gconv']] },
  LOCPATH: { vm: [['LOCPATH', '/work/locales']] },
  NLSPATH: { vm: [['NLSPATH', '/work/%N']] },
  HOSTALIASES: { vm: [['HOSTALIASES', '/work/hosts']] },
  'LD_*': { vm: [['LD_PRELOAD', '/work/evil.so'], ['LD_LIBRARY_PATH', '/work'], ['LD_AUDIT', '/work/a.so'], ['LD_DEBUG', 'all']] },
  'MALLOC_*': { vm: [['MALLOC_CHECK_', '3'], ['MALLOC_ARENA_MAX', '1'], ['MALLOC_PERTURB_', '165']] },
  GLIBC_TUNABLES: { vm: [['GLIBC_TUNABLES', 'glibc.malloc.check=3']] },
  TERM: { vm: [['TERM', '../../work/ti']], fastpath: [['TERM', 'xterm-256color']] },
  display: { vm: [['PAGER', 'less'], ['GIT_PAGER', '/work/p']], fastpath: [['COLUMNS', '80'], ['NO_COLOR', '1'], ['FORCE_COLOR', '1'], ['GREP_COLORS', 'mt=01;31'], ['PAGER', 'cat']] },
};

const quote = (v: string) => `'${v.replace(/'/g, `'\\''`)}'`;

describe('a variable routes the same inline and in the call environment', () => {
  let b: TestBroker;
  let sb: Sandbox;

  beforeAll(async () => {
    b = await startBroker();
    sb = await (await b.connect()).create();
  });
  afterAll(async () => b?.stop());

  for (const [family, cases] of Object.entries(FAMILIES)) {
    it(family, async () => {
      for (const [expected, list] of [['vm', cases.vm], ['fastpath', cases.fastpath ?? []]] as const) {
        for (const [name, value] of list) {
          const inEnv = await sb.run('ls nosuch', { env: { [name]: value } });
          const inline = await sb.run(`${name}=${quote(value)} ls nosuch`);
          const assigned = await sb.run(`${name}=${quote(value)}; ls nosuch`);
          const what = `${name}=${value}: env ${inEnv.route} (${inEnv.reason}), inline ${inline.route} (${inline.reason}), assigned ${assigned.route}`;
          expect(inEnv.route, what).toBe(expected);
          expect(inline.route, what).toBe(expected);
          expect(assigned.route, what).toBe(expected);
        }
      }
    });
  }
});
