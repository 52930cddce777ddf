import type { Handlers } from '../protocol/connection.ts';
import { TelemetrySampler } from './sampler.ts';

export interface TelemetryContext {
  workloadCgroup?: string | undefined;
}

/** Handlers of the telemetry.* methods. */
export function telemetryHandlers(ctx: TelemetryContext): Handlers {
  const sampler = new TelemetrySampler(ctx.workloadCgroup);
  return {
    'telemetry.sample': (p) => sampler.sample(p),
  };
}
