import { buildAgent } from '../../guest-agent/build.ts';

/** The tests run the agent exactly as the guest does: the bundled plain-JS file. */
export default async function setup(): Promise<void> {
  await buildAgent();
}
