import type { Handlers } from '../protocol/connection.ts';

export interface TelemetryContext {
  workloadCgroup?: string | undefined;
}

/** Handlers of the telemetry.* methods. */
export function telemetryHandlers(_ctx: TelemetryContext): Handlers {
  return {};
}
