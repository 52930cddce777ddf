/**
 * deploy/kubernetes renders offline with kustomize and every rendered object validates
 * against the Kubernetes API schemas (kubernetes-models ships them; no cluster, no network).
 * Then what the deployment promises: brokers only on KVM nodes with /dev/kvm and the data dir
 * from the host, liveness on /healthz and readiness on /readyz, a preStop drain, requests;
 * gateways behind a Service; the catalog; tokens from a Secret; metrics annotations; the
 * image the Containerfile builds, by the name it gives it; and every command and flag in a
 * container is one the image and the hutch CLI have.
 */
import { execFileSync, spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { describe, expect, it } from 'vitest';
import { parseAllDocuments } from 'yaml';
import { Namespace } from 'kubernetes-models/v1/Namespace';
import { Service } from 'kubernetes-models/v1/Service';
import { DaemonSet } from 'kubernetes-models/apps/v1/DaemonSet';
import { Deployment } from 'kubernetes-models/apps/v1/Deployment';
import { StatefulSet } from 'kubernetes-models/apps/v1/StatefulSet';
import { PodDisruptionBudget } from 'kubernetes-models/policy/v1/PodDisruptionBudget';
import { NetworkPolicy } from 'kubernetes-models/networking.k8s.io/v1/NetworkPolicy';

const repo = resolve(import.meta.dirname, '..');
const base = resolve(repo, 'deploy/kubernetes');

/** The schema class for each apiVersion/kind the base may contain. */
const MODELS: Record<string, new (o: never) => { validate(): void }> = {
  'v1/Namespace': Namespace,
  'v1/Service': Service,
  'apps/v1/DaemonSet': DaemonSet,
  'apps/v1/Deployment': Deployment,
  'apps/v1/StatefulSet': StatefulSet,
  'policy/v1/PodDisruptionBudget': PodDisruptionBudget,
  'networking.k8s.io/v1/NetworkPolicy': NetworkPolicy,
};

/**
 * kubectl kustomize, else a standalone kustomize: one whose kustomize reads `labels`
 * (kustomize >= 4.1, kubectl >= 1.22). Debian bookworm's kubectl 1.20 does not.
 */
function renderer(): { cmd: string; args: string[] } | undefined {
  const probe = mkdtempSync(join(tmpdir(), 'hutch-kustomize-'));
  try {
    writeFileSync(join(probe, 'kustomization.yaml'), 'labels:\n  - pairs: { a: b }\nresources: [cm.yaml]\n');
    writeFileSync(join(probe, 'cm.yaml'), 'apiVersion: v1\nkind: ConfigMap\nmetadata: { name: x }\n');
    for (const c of [{ cmd: 'kubectl', args: ['kustomize'] }, { cmd: 'kustomize', args: ['build'] }]) {
      const r = spawnSync(c.cmd, [...c.args, probe], { encoding: 'utf8' });
      if (!r.error && r.status === 0 && r.stdout.includes('a: b')) return { cmd: c.cmd, args: [...c.args, base] };
    }
    return undefined;
  } finally {
    rmSync(probe, { recursive: true, force: true });
  }
}

const render = renderer();
if (!render) console.log('SKIPPING test/deploy-kubernetes.test.ts: no `kubectl kustomize` or `kustomize` that reads `labels` (kustomize >= 4.1, kubectl >= 1.22; Debian bookworm\'s kubectl 1.20 is older)');

type Obj = { apiVersion: string; kind: string; metadata: { name: string; annotations?: Record<string, string> }; spec?: Record<string, unknown> };
type Container = { name: string; command?: string[]; args?: string[]; env?: Array<{ name: string }>; volumeMounts?: Array<{ name: string; mountPath: string }>; resources?: { requests?: Record<string, string> }; livenessProbe?: { httpGet?: { path: string } }; readinessProbe?: { httpGet?: { path: string } }; lifecycle?: { preStop?: unknown } };
type PodSpec = { nodeSelector?: Record<string, string>; containers: Container[]; initContainers?: Container[]; volumes?: Array<{ name: string; hostPath?: { path: string }; secret?: { secretName: string } }> };

describe.skipIf(!render)('deploy/kubernetes', () => {
  const rendered = render ? spawnSync(render.cmd, render.args, { encoding: 'utf8' }) : undefined;
  const objects = (() => {
    if (!rendered) return [] as Obj[];
    if (rendered.status !== 0) throw new Error(`${render?.cmd} ${render?.args.join(' ')} failed: ${rendered.stderr}`);
    return parseAllDocuments(rendered.stdout).map((d) => d.toJS() as Obj).filter(Boolean);
  })();
  const find = (kind: string, name: string) => {
    const o = objects.find((x) => x.kind === kind && x.metadata.name === name);
    if (!o) throw new Error(`no ${kind} ${name} in the rendered base`);
    return o;
  };
  const pod = (o: Obj) => (o.spec as { template: { spec: PodSpec; metadata: { annotations?: Record<string, string> } } }).template;

  it('every rendered object validates against the Kubernetes API schema of its kind', () => {
    expect(objects.length).toBeGreaterThanOrEqual(7);
    for (const o of objects) {
      const Model = MODELS[`${o.apiVersion}/${o.kind}`];
      if (!Model) throw new Error(`no schema for ${o.apiVersion} ${o.kind}`);
      expect(() => new Model(o as never).validate(), `${o.kind} ${o.metadata.name}`).not.toThrow();
    }
  });

  it('the schemas do reject a malformed object (the check above can fail)', () => {
    const ds = structuredClone(find('DaemonSet', 'hutch-broker')) as Obj;
    (pod(ds).spec as unknown as { containers: unknown }).containers = 'not a list';
    expect(() => new DaemonSet(ds as never).validate()).toThrow();
    const svc = structuredClone(find('Service', 'hutch-gateway')) as Obj;
    (svc.spec as { ports: Array<{ port: unknown }> }).ports[0]!.port = 'seventy';
    expect(() => new Service(svc as never).validate()).toThrow();
  });

  it('brokers: a DaemonSet on KVM nodes with /dev/kvm and the data dir from the host, probes, requests, a preStop drain', () => {
    const ds = find('DaemonSet', 'hutch-broker');
    const t = pod(ds);
    expect(t.spec.nodeSelector).toEqual({ 'hutch.dev/kvm': 'true' });
    const c = t.spec.containers.find((x) => x.name === 'broker') as Container;
    const hostPaths = Object.fromEntries((t.spec.volumes ?? []).filter((v) => v.hostPath).map((v) => [v.name, v.hostPath?.path]));
    const mounts = Object.fromEntries((c.volumeMounts ?? []).map((m) => [m.mountPath, m.name]));
    expect(hostPaths[mounts['/dev/kvm'] as string]).toBe('/dev/kvm');
    expect(hostPaths[mounts['/var/lib/hutch'] as string]).toBe('/var/lib/hutch');
    expect(c.args).toContain('--data-dir=/var/lib/hutch');
    expect(c.livenessProbe?.httpGet?.path).toBe('/healthz');
    expect(c.readinessProbe?.httpGet?.path).toBe('/readyz');
    expect(c.resources?.requests?.['cpu']).toBeDefined();
    expect(c.resources?.requests?.['memory']).toBeDefined();
    expect(JSON.stringify(c.lifecycle?.preStop)).toContain('kill -TERM 1');
    // The broker is a cluster member: catalog, stable id from the node, credential from the Secret.
    expect(c.args).toEqual(expect.arrayContaining(['--catalog=redis://hutch-redis:6379', '--broker-id=$(NODE_NAME)', '--gateway-token-file=/etc/hutch/gateway-token']));
    expect(t.metadata.annotations?.['prometheus.io/scrape']).toBe('true');
    // The grace period outlasts the drain.
    const drainMs = Number((c.args ?? []).find((a) => a.startsWith('--drain-ms='))?.split('=')[1]);
    expect((t.spec as { terminationGracePeriodSeconds?: number }).terminationGracePeriodSeconds! * 1000).toBeGreaterThan(drainMs);
  });

  it('gateways: a Deployment behind a Service, the catalog as a StatefulSet, tokens from a Secret', () => {
    const dep = find('Deployment', 'hutch-gateway');
    expect((dep.spec as { replicas: number }).replicas).toBeGreaterThanOrEqual(2);
    const svc = find('Service', 'hutch-gateway');
    expect((svc.spec as { selector: Record<string, string> }).selector['app.kubernetes.io/name']).toBe('hutch-gateway');
    find('StatefulSet', 'hutch-redis');
    find('Service', 'hutch-redis');
    for (const o of [dep, find('DaemonSet', 'hutch-broker')]) {
      const secrets = (pod(o).spec.volumes ?? []).filter((v) => v.secret).map((v) => v.secret?.secretName);
      expect(secrets).toEqual(['hutch-secrets']);
    }
    // Only hutch's own pods reach the catalog, and only gateways a broker's harness port.
    const from = (name: string) =>
      ((find('NetworkPolicy', name).spec as { ingress: Array<{ from?: Array<{ podSelector: { matchLabels: Record<string, string> } }> }> }).ingress ?? [])
        .flatMap((r) => r.from ?? [])
        .map((f) => f.podSelector.matchLabels['app.kubernetes.io/name']);
    expect(from('hutch-redis').sort()).toEqual(['hutch-broker', 'hutch-gateway']);
    expect(from('hutch-broker')).toEqual(['hutch-gateway']);
    // No token in the rendered base: they come from the Secret only.
    expect(JSON.stringify(objects)).not.toMatch(/token=[^/]/);
  });

  it('renders without a warning (no deprecated field such as commonLabels)', () => {
    expect(rendered?.stderr).toBe('');
    expect(readFileSync(join(base, 'kustomization.yaml'), 'utf8')).not.toMatch(/^commonLabels:/m);
  });

  it("hutch's containers run the image the Containerfile builds, by the name its build command gives it, and only commands that image has", () => {
    const containerfile = readFileSync(join(repo, 'Containerfile'), 'utf8');
    const built = /podman build -t (\S+) \./.exec(containerfile)?.[1];
    expect(built, 'the Containerfile names its build command').toBeDefined();
    // What the image puts on PATH: hutch (a link to the clone's entry point), and the base image's shell.
    const provided = new Set(['/bin/sh', ...[...containerfile.matchAll(/ln -s \S+ \/usr\/local\/bin\/(\S+)/g)].map((m) => m[1] as string)]);
    expect(provided.has('hutch')).toBe(true);
    let checked = 0;
    for (const o of objects.filter((x) => ['DaemonSet', 'Deployment'].includes(x.kind))) {
      for (const c of [...pod(o).spec.containers, ...(pod(o).spec.initContainers ?? [])] as Array<Container & { image: string; lifecycle?: { preStop?: { exec?: { command: string[] } } } }>) {
        if (!c.image.includes('hutch')) continue;
        expect(c.image, `${o.metadata.name}/${c.name}`).toBe(built);
        expect(provided.has(c.command?.[0] ?? ''), `${o.metadata.name}/${c.name}: ${c.command?.[0]} is not in the image`).toBe(true);
        const hook = c.lifecycle?.preStop?.exec?.command[0];
        if (hook) expect(provided.has(hook), `${o.metadata.name}/${c.name} preStop: ${hook}`).toBe(true);
        checked++;
      }
    }
    expect(checked).toBe(3);
  });

  it('every command and flag the containers pass is one the hutch CLI knows', () => {
    const helpOf = (sub: string) => execFileSync(process.execPath, ['--import', 'tsx', 'host-broker/src/cli.ts', sub, '--help'], { cwd: repo, encoding: 'utf8' });
    let checked = 0;
    for (const o of objects.filter((x) => ['DaemonSet', 'Deployment'].includes(x.kind))) {
      for (const c of [...pod(o).spec.containers, ...(pod(o).spec.initContainers ?? [])]) {
        if (c.command?.[0] !== 'hutch') continue;
        const [sub, ...args] = c.args ?? [];
        const help = helpOf(sub as string);
        expect(help, `${o.metadata.name}/${c.name}: hutch ${sub}`).toMatch(new RegExp(`^usage: hutch ${sub} `));
        for (const a of args) if (a.startsWith('--')) expect(help, `${o.metadata.name}: ${a}`).toContain(`${a.split('=')[0]} `);
        checked++;
      }
    }
    expect(checked).toBeGreaterThanOrEqual(3);
  });
});
