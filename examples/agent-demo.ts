/**
 * Starts a real guest agent process on a Unix socket with a scratch workspace and drives
 * it the way the broker does: file tools, a streamed command, stdin, a timeout, an
 * escape attempt. `npx tsx examples/agent-demo.ts [--keep]`
 */
import { spawn } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { buildAgent } from '../guest-agent/build.ts';
import { AgentClient } from '../host-broker/src/agent-client.ts';
import { waitForSocket } from '../host-broker/src/util/wait-for-socket.ts';

const dir = mkdtempSync(join(tmpdir(), 'hutch-demo-'));
const root = join(dir, 'work');
await import('node:fs').then((fs) => fs.mkdirSync(root));
const bundle = await buildAgent(join(dir, 'hutch-agent.mjs'));
const sock = join(dir, 'agent.sock');
const agent = spawn(process.execPath, [bundle.path, '--listen', `unix:${sock}`, '--root', root, '--kill-on-exit', '--log-level', 'warn'], { stdio: 'inherit' });
const step = (s: string) => process.stdout.write(`\n\x1b[1m== ${s}\x1b[0m\n`);
try {
  await waitForSocket(sock, { proc: agent });
  const c = await AgentClient.connectUnix(sock);
  step(`connected to agent pid ${String(c.capabilities['pid'])} (bundle ${(bundle.bytes / 1024).toFixed(0)} KiB)`);

  step('write + read + edit');
  await c.call('fs.write', { path: 'hello.py', content: 'print("hello from hutch")\n' });
  await c.call('fs.edit', { path: 'hello.py', oldString: 'hutch', newString: 'the agent' });
  process.stdout.write((await c.call('fs.read', { path: 'hello.py' })).content + '\n');

  step('a command with streamed output');
  const r = await c.exec({
    command: 'for i in 1 2 3; do echo "tick $i"; sleep 0.2; done; python3 hello.py 2>/dev/null || echo "(no python3)"',
    onStdout: (chunk) => void process.stdout.write(chunk),
  }).result;
  process.stdout.write(`exit ${r.exitCode} in ${r.durationMs.toFixed(0)} ms\n`);

  step('stdin, and a timeout that kills the whole process group');
  process.stdout.write((await c.run({ command: 'tr a-z A-Z', stdin: Buffer.from('piped through tr\n') })).stdoutText);
  const t = await c.run({ command: 'sleep 60 & sleep 60', timeoutMs: 500 });
  process.stdout.write(`timedOut=${t.timedOut} signal=${t.signal}\n`);

  step('an escape attempt');
  await c.call('fs.read', { path: '../../etc/passwd' }).catch((e: { code: string; message: string }) => process.stdout.write(`${e.code}: ${e.message}\n`));

  step('glob + grep');
  process.stdout.write(JSON.stringify(await c.call('fs.glob', { pattern: '**/*.py' })) + '\n');
  process.stdout.write(JSON.stringify(await c.call('fs.grep', { pattern: 'print' })) + '\n');
  c.close();
} finally {
  agent.kill('SIGTERM');
  if (!process.argv.includes('--keep')) rmSync(dir, { recursive: true, force: true });
}
