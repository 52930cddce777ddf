/**
 * The broker's side of every sandbox's network: the operator's defaults (what a sandbox
 * gets when it asks for nothing, and the most it may ask for), the limits, and one
 * SandboxNetwork per session built from the session's own request.
 */
import { HutchError } from '../../../guest-agent/src/protocol/errors.ts';
import type { NetworkSpec } from '../api/harness-protocol.ts';
import { ownAddresses, type RangeSet } from './addresses.ts';
import { parseRules, type EgressMode, type EgressPolicy, type EgressRule } from './egress-policy.ts';
import { DEFAULT_NETWORK_LIMITS, PrincipalConnections, SandboxNetwork, type NetworkLimits } from './sandbox-network.ts';
import { hostRegistries, type HostRegistries } from './registries.ts';
import { GUEST_MIRROR, GUEST_SECURITY_MIRROR } from '../../../rootfs/packages.ts';

export interface NetworkDefaults {
  /** What a sandbox that asks for nothing (or `default`) gets. */
  mode: EgressMode;
  /** The allowlist of `allowlist` mode (and of `default` when that is the mode); absent: the host's package registries. */
  allowlist?: readonly string[];
  /** The most a sandbox may ask for: `public` above it is refused at create. */
  max: EgressMode;
  limits: NetworkLimits;
  /** Proxied connections one principal's sandboxes hold at once. */
  perPrincipalConnections: number;
}

const RANK: Record<EgressMode, number> = { none: 0, allowlist: 1, public: 2 };

export class Networks {
  private own: RangeSet = ownAddresses();
  private ownAt = Date.now();
  private readonly principals: PrincipalConnections;
  private readonly defaultRules: EgressRule[];
  /** The package registries the host is configured with (read once at start). */
  readonly registries: HostRegistries;
  /** What every VM command gets so its package managers use the host's registries (a mirror included). */
  readonly guestEnv: Record<string, string>;

  constructor(
    readonly defaults: NetworkDefaults,
    private readonly hooks: Pick<ConstructorParameters<typeof SandboxNetwork>[0], 'onEvent' | 'onBytes'> = {},
  ) {
    this.principals = new PrincipalConnections(defaults.perPrincipalConnections);
    this.registries = hostRegistries({ guestApt: [GUEST_MIRROR, GUEST_SECURITY_MIRROR] });
    this.defaultRules = parseRules(defaults.allowlist ?? this.registries.rules, 'the default allowlist');
    this.guestEnv = registryEnv(this.registries);
  }

  /** The default allowlist's rules as text (the broker's start log and `hutch serve --help`'s readers). */
  get defaultAllowlist(): string[] {
    return this.defaultRules.map((r) => r.text);
  }

  /** The host's addresses, re-read at most every 10 s (interfaces come and go; the check must see them). */
  private ownNow = (): RangeSet => {
    if (Date.now() - this.ownAt > 10_000) {
      this.own = ownAddresses();
      this.ownAt = Date.now();
    }
    return this.own;
  };

  /** The policy a request resolves to; `bad_request` for a malformed rule or more than --egress-max allows. */
  resolve(spec: NetworkSpec | undefined): EgressPolicy {
    const s: Exclude<NetworkSpec, string> = typeof spec === 'string' || spec === undefined ? { base: spec ?? 'default' } : spec;
    const base = s.base ?? 'default';
    const allow = parseRules(s.allow ?? [], 'network.allow');
    const deny = parseRules(s.deny ?? [], 'network.deny');
    let mode: EgressMode;
    let rules: EgressRule[] = [];
    if (base === 'public') mode = 'public';
    else if (base === 'none') mode = 'none';
    else {
      mode = this.defaults.mode;
      if (mode === 'allowlist') rules = this.defaultRules;
    }
    // Rules of one's own on a closed base make an allowlist of just those.
    if (mode === 'none' && allow.length > 0) mode = 'allowlist';
    if (RANK[mode] > RANK[this.defaults.max]) {
      throw new HutchError('bad_request', `network: this broker lets a sandbox have at most ${this.defaults.max} egress (--egress-max); asked ${mode}`, { asked: mode, max: this.defaults.max });
    }
    return { mode, allow: [...rules, ...allow], deny, ...(s.precedence === 'allow' ? { allowBeatsDeny: true } : {}) };
  }

  /** A session's network, under its own policy and the broker's limits. */
  forSession(session: string, principal: string, spec: NetworkSpec | undefined): SandboxNetwork {
    return new SandboxNetwork({
      session,
      principal,
      policy: this.resolve(spec),
      own: this.ownNow,
      limits: this.defaults.limits,
      principalConnections: this.principals,
      ...this.hooks,
    });
  }
}

/** Registry settings for the guest's tools, for the ones that are not their defaults and reachable (http/https). */
function registryEnv(r: HostRegistries): Record<string, string> {
  const web = (u: string) => /^https?:\/\//i.test(u);
  const env: Record<string, string> = {};
  if (web(r.npm) && !/^https:\/\/registry\.npmjs\.org\/?$/.test(r.npm)) env['npm_config_registry'] = r.npm;
  if (web(r.pip.index) && !/^https:\/\/pypi\.org\/simple\/?$/.test(r.pip.index)) env['PIP_INDEX_URL'] = r.pip.index;
  const extra = r.pip.extra.filter(web);
  if (extra.length) env['PIP_EXTRA_INDEX_URL'] = extra.join(' ');
  return env;
}

export const DEFAULT_NETWORK: NetworkDefaults = {
  mode: 'allowlist',
  max: 'public',
  limits: DEFAULT_NETWORK_LIMITS,
  perPrincipalConnections: 256,
};
