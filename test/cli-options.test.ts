/**
 * The one option parser (guest-agent/src/cli-options.ts) on its own: values converted and
 * checked, defaults and environment fallbacks, repeatable options, positionals, a mistyped
 * option named with the one meant, help generated from the declarations.
 */
import { describe, expect, it } from 'vitest';
import { Command, int, isUsageError, oneOf, port, UsageError } from '../guest-agent/src/cli-options.ts';

const cmd = new Command({
  name: 'hutch thing',
  usage: 'NAME [options]',
  summary: 'Does a thing.',
  positionals: { min: 1, max: 1 },
  options: {
    port: { arg: 'N', help: 'a port (default 7070)', default: '7070', parse: port },
    level: { arg: 'L', help: 'a level', env: 'THING_LEVEL', parse: oneOf(['low', 'high'] as const) },
    tag: { arg: 'T', help: 'repeatable', multiple: true },
    count: { arg: 'N', help: 'from 1 to 5', parse: int(1, 5), group: 'more' },
    quiet: { help: 'a switch', short: 'q' },
  },
});

const usage = (f: () => unknown): Error => {
  try {
    f();
  } catch (err) {
    expect(isUsageError(err), String(err)).toBe(true);
    return err as Error;
  }
  throw new Error('accepted');
};

describe('Command', () => {
  it('converts values, applies defaults and the environment, keeps repeats in order', () => {
    const p = cmd.parse(['one', '--tag', 'a', '-q', '--tag=b', '--count', '3'], { env: { THING_LEVEL: 'high' } });
    expect(p).toEqual({ values: { port: 7070, level: 'high', tag: ['a', 'b'], count: 3, quiet: true }, positionals: ['one'] });
    expect(cmd.parse(['one', '--level', 'low'], { env: { THING_LEVEL: 'high' } })?.values.level).toBe('low');
    expect(cmd.parse(['one'], { env: {} })?.values).toEqual({ port: 7070, level: undefined, tag: [], count: undefined, quiet: false });
  });

  it('refuses a bad value with the option (or its environment variable) named', () => {
    expect(usage(() => cmd.parse(['one', '--port', 'x'], { env: {} })).message).toMatch(/^--port must be a port number/);
    expect(usage(() => cmd.parse(['one', '--count', '6'], { env: {} })).message).toBe('--count must be a whole number from 1 to 5, got "6"');
    expect(usage(() => cmd.parse(['one'], { env: { THING_LEVEL: 'mid' } })).message).toMatch(/^--level \(from THING_LEVEL\) must be one of low, high/);
    // A parse function throwing anything: the message gets the option's name.
    const c = new Command({ name: 'x', summary: 's', options: { a: { arg: 'A', help: 'h', parse: () => { throw new Error('no good'); } } } });
    expect(usage(() => c.parse(['--a', '1'])).message).toBe('--a: no good');
    expect(new UsageError('m', '--a').context).toEqual({ usage: true, option: '--a' });
  });

  it('names a mistyped option with the one meant, and refuses missing or extra arguments', () => {
    expect(usage(() => cmd.parse(['one', '--prot', '1'])).message).toBe('unknown option --prot; did you mean --port? (see hutch thing --help)');
    expect(usage(() => cmd.parse(['one', '--zzzzzz'])).message).toBe('unknown option --zzzzzz (see hutch thing --help)');
    expect(usage(() => cmd.parse(['one', '--port'])).message).toMatch(/^--port needs a value/);
    expect(usage(() => cmd.parse(['one', '--quiet=yes'])).message).toMatch(/^--quiet takes no value/);
    expect(usage(() => cmd.parse([])).message).toMatch(/^missing argument: usage: hutch thing NAME/);
    expect(usage(() => cmd.parse(['one', 'two'])).message).toMatch(/^unexpected argument "two"/);
  });

  it('prints its own help, from the declarations, for -h and --help', () => {
    let out = '';
    expect(cmd.parse(['-h'], { out: (t) => (out += t) })).toBeUndefined();
    expect(out).toBe(cmd.help());
    expect(out).toContain('usage: hutch thing NAME [options]\n\nDoes a thing.\n');
    expect(out).toMatch(/^ {2}--port N {16}a port \(default 7070\)$/m);
    expect(out).toMatch(/^ {2}-q, --quiet {13}a switch$/m);
    expect(out).toMatch(/^more:\n {2}--count N/m);
    expect(out).toMatch(/^ {2}-h, --help {14}this help$/m);
  });
});
