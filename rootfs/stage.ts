/**
 * The default template's tree: a copy of the base tree plus what every template root
 * gets (the tenant user, mount points, /etc/hutch settings: the template build does the
 * same inside its VM, guest/build.sh), normalised for a reproducible mkfs. The agent and
 * init are the agent layer's (agent-layer.ts), not in here.
 *
 * The copy goes to a tmpfs in name-sorted order (GNU tar --sort=name). mke2fs
 * 1.47.0 adds directory entries in readdir order, and on tmpfs that order is
 * the creation order, so sorted creation gives the same image on every run;
 * on the host's ext4 it would follow that filesystem's private hash seed.
 */
import { appendFile, chmod, chown, copyFile, mkdir, readFile, readdir, writeFile } from "node:fs/promises";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { run } from "../build/run.ts";

const GUEST_DIR = path.join(path.dirname(fileURLToPath(import.meta.url)), "guest");

/**
 * Guest files baked into the default template, with their modes. Part of its cache key.
 * /etc/hutch/start is the template's start command (init runs it before the agent, so the
 * pristine snapshot holds its warm page cache): here, the Python stdlib preload.
 */
export const GUEST_FILES: readonly { src: string; dest: string; mode: number }[] = [
  { src: path.join(GUEST_DIR, "default-start.sh"), dest: "etc/hutch/start", mode: 0o644 },
  { src: path.join(GUEST_DIR, "boot.py"), dest: "etc/hutch/boot.py", mode: 0o644 },
];

/** The unprivileged user tenant commands run as (the agent's --run-as). */
export const TENANT = { name: "tenant", uid: 1000, gid: 1000, home: "home/tenant", shell: "/bin/bash" } as const;

/** Days since the epoch for /etc/shadow's "last change" field: fixed, so the image stays reproducible. */
function shadowDay(epoch: number): number {
  return Math.floor(epoch / 86400);
}

async function copyTreeSorted(from: string, to: string): Promise<void> {
  await mkdir(to, { recursive: true });
  // Positional parameters keep the paths out of the script text.
  await run([
    "sh",
    "-c",
    'set -e; tar -C "$1" --sort=name --numeric-owner --xattrs --xattrs-include="*" -cf - . | tar -C "$2" --numeric-owner --xattrs --xattrs-include="*" -xpf -',
    "sh",
    from,
    to,
  ]);
}

async function addTenant(root: string, epoch: number): Promise<void> {
  const passwd = await readFile(path.join(root, "etc/passwd"), "utf8");
  if (passwd.split("\n").some((l) => l.split(":")[2] === String(TENANT.uid) || l.startsWith(`${TENANT.name}:`))) {
    throw new Error(`the base tree already has uid ${TENANT.uid} or a user named ${TENANT.name}: ${path.join(root, "etc/passwd")}`);
  }
  const home = `/${TENANT.home}`;
  await appendFile(path.join(root, "etc/passwd"), `${TENANT.name}:x:${TENANT.uid}:${TENANT.gid}:hutch tenant:${home}:${TENANT.shell}\n`);
  await appendFile(path.join(root, "etc/group"), `${TENANT.name}:x:${TENANT.gid}:\n`);
  // Locked password: nobody logs in, commands are started by the agent.
  await appendFile(path.join(root, "etc/shadow"), `${TENANT.name}:!:${shadowDay(epoch)}:0:99999:7:::\n`);
  await appendFile(path.join(root, "etc/gshadow"), `${TENANT.name}:!::\n`);

  const homeDir = path.join(root, TENANT.home);
  await mkdir(homeDir, { recursive: true });
  const skel = path.join(root, "etc/skel");
  for (const name of await readdir(skel)) await copyFile(path.join(skel, name), path.join(homeDir, name));
  for (const name of [".", ...(await readdir(homeDir))]) await chown(path.join(homeDir, name), TENANT.uid, TENANT.gid);
  await chmod(homeDir, 0o755);
}

export interface StageInputs {
  baseTree: string;
  stageDir: string;
  /** Written to /etc/hutch/image.json (must be deterministic: no build times). */
  imageInfo: Record<string, unknown>;
  epoch: number;
}

/** Builds the image tree in `stageDir` (which should be on a tmpfs, see above). */
export async function stageTree(inp: StageInputs): Promise<void> {
  const root = inp.stageDir;
  await copyTreeSorted(inp.baseTree, root);

  // The agent layer's mount point (init pivots the layer there).
  await mkdir(path.join(root, "opt/hutch"), { recursive: true });
  for (const f of GUEST_FILES) {
    const dest = path.join(root, f.dest);
    await mkdir(path.dirname(dest), { recursive: true });
    await copyFile(f.src, dest);
    await chmod(dest, f.mode);
  }
  await writeFile(path.join(root, "etc/hutch/image.json"), `${JSON.stringify(inp.imageInfo, null, 2)}\n`);

  await addTenant(root, inp.epoch);
  // Mount points: /work and /tmp become tmpfs at boot; /run holds the overlay.
  for (const d of ["work", "tmp", "run", "proc", "sys", "dev"]) await mkdir(path.join(root, d), { recursive: true });
  await chown(path.join(root, "work"), TENANT.uid, TENANT.gid);
  await chmod(path.join(root, "tmp"), 0o1777);
  await writeFile(path.join(root, "etc/hostname"), "hutch\n");
  await writeFile(path.join(root, "etc/hosts"), "127.0.0.1\tlocalhost hutch\n::1\t\tlocalhost ip6-localhost ip6-loopback\n");

  // Every timestamp -> epoch (-h: the links themselves, not their targets).
  await run(["sh", "-c", 'find "$1" -print0 | xargs -0 touch -h -d "@$2"', "sh", root, String(inp.epoch)]);
}
