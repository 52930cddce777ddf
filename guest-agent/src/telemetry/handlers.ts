import { memoryPolicyOutcome } from '../memory/handlers.ts';
import type { ExecService } from '../process/exec-handler.ts';
import type { Handlers } from '../protocol/connection.ts';
import { TelemetrySampler } from './sampler.ts';

export interface TelemetryContext {
  workloadCgroup?: string | undefined;
  /** The agent's exec service: names the agent whose memory policy outcome samples carry. */
  execs?: ExecService | undefined;
}

/** Handlers of the telemetry.* methods. */
export function telemetryHandlers(ctx: TelemetryContext): Handlers {
  const sampler = new TelemetrySampler(ctx.workloadCgroup, () => memoryPolicyOutcome({ execs: ctx.execs }));
  return {
    'telemetry.sample': (p) => sampler.sample(p),
  };
}
