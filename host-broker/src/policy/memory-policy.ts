import { DEFAULT_MEMORY_POLICY, MemoryPolicyStepsSchema, type MemoryPolicySteps } from '../../../guest-agent/src/protocol/methods-memory.ts';
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { SandboxPolicy } from './sandbox-policy.ts';

/**
 * The steps of the guest's own memory policy a session's VM runs with (the agent applies
 * them: guest-agent/src/memory/policy.ts). The broker's policy may switch any of them off
 * for measurement; its `prefetch` flag (the published levels) is the prefetch step.
 */
export function memoryStepsFor(policy: SandboxPolicy): MemoryPolicySteps {
  const m = { ...DEFAULT_MEMORY_POLICY, ...policy.memoryPolicy };
  return { ...m, prefetch: m.prefetch && policy.prefetch };
}

/** `--memory-steps damon=off,prefetch=off`: steps switched on or off, validated against the protocol. */
export function parseMemorySteps(text: string): Partial<MemoryPolicySteps> {
  const out: Record<string, boolean> = {};
  for (const item of text.split(',').filter((s) => s.trim() !== '')) {
    const [k, v] = item.split('=').map((s) => s.trim());
    if (v !== 'on' && v !== 'off') throw new HutchError('bad_request', `--memory-steps ${item}: expected STEP=on|off`);
    out[k as string] = v === 'on';
  }
  const r = MemoryPolicyStepsSchema.partial().strict().safeParse(out);
  if (!r.success) throw new HutchError('bad_request', `--memory-steps: unknown step; steps are ${Object.keys(DEFAULT_MEMORY_POLICY).join(', ')}`);
  return r.data;
}
