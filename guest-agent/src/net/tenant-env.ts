import { existsSync } from 'node:fs';
import { GUEST_PROXY_PORT } from '../protocol/methods-net.ts';

/** The host's CA bundle, carried in the agent layer (rootfs/agent-layer.ts): a host behind a TLS-inspecting proxy has its CA in it. */
export const GUEST_CA_BUNDLE = '/opt/hutch/ca-certificates.crt';

/**
 * What tenant commands in a VM need to reach the network without configuration: the
 * proxy variables (both spellings: curl, wget, pip, npm, apt, git and Python read one or
 * the other) pointing at the agent's proxy port, loopback excepted, and the host's CA
 * bundle for every tool that keeps its own trust store.
 */
export function guestNetworkEnv(port = GUEST_PROXY_PORT, caBundle = GUEST_CA_BUNDLE): Record<string, string> {
  const proxy = `http://127.0.0.1:${port}`;
  const env: Record<string, string> = {
    http_proxy: proxy,
    https_proxy: proxy,
    HTTP_PROXY: proxy,
    HTTPS_PROXY: proxy,
    no_proxy: 'localhost,127.0.0.1,::1',
    NO_PROXY: 'localhost,127.0.0.1,::1',
    // git:// and other plain TCP: git connects through the proxy with CONNECT (socat is in the image).
    GIT_PROXY_COMMAND: '/opt/hutch/bin/git-proxy',
  };
  if (existsSync(caBundle)) {
    for (const k of ['SSL_CERT_FILE', 'NODE_EXTRA_CA_CERTS', 'REQUESTS_CA_BUNDLE', 'PIP_CERT', 'CURL_CA_BUNDLE', 'GIT_SSL_CAINFO']) env[k] = caBundle;
  }
  return env;
}
