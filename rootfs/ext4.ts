/**
 * A reproducible ext4 image from a directory tree (mke2fs -d: no loop mount,
 * no root-only mount syscalls beyond what the tree already needed).
 *
 * Reproducible means: the same tree (same contents, modes, owners, mtimes,
 * and the same directory order, see stage.ts) gives a byte-identical image.
 * mke2fs picks a random UUID and directory hash seed and stamps the current
 * time on the superblock and new inodes: all three are pinned here (-U,
 * -E hash_seed, E2FSPROGS_FAKE_TIME; e2fsprogs 1.47.0 predates its
 * SOURCE_DATE_EPOCH support, which is set too for newer versions). It also
 * copies each file's ctime from the tree, which no tool can set, so a debugfs
 * pass rewrites atime/ctime of every inode afterwards. The features come from a
 * private mke2fs.conf, not the host's, so a host config change cannot alter
 * the image either.
 */
import { mkdtemp, rm, stat, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import path from "node:path";
import { capture, run } from "../build/run.ts";

/** No journal: the root is mounted read-only, a journal would only cost space. */
const MKE2FS_CONF = `[defaults]
	base_features = sparse_super,large_file,filetype,resize_inode,dir_index,ext_attr
	default_mntopts = acl,user_xattr
	enable_periodic_fsck = 0
	blocksize = 4096
	inode_size = 256
	inode_ratio = 16384

[fs_types]
	ext4 = {
		features = extent,huge_file,flex_bg,metadata_csum,64bit,dir_nlink,extra_isize
	}
`;

export interface Ext4Options {
  /** Source tree (its root directory's contents become the filesystem root). */
  dir: string;
  out: string;
  /** Seconds since the epoch stamped on every inode and the superblock. */
  epoch: number;
  /** Filesystem UUID, also used as the directory hash seed. */
  uuid: string;
  label: string;
  log?: (message: string) => void;
}

export interface Ext4Result {
  /** Size of the image file (the filesystem size). */
  sizeBytes: number;
  /** Bytes the sparse image file really occupies on the host. */
  allocatedBytes: number;
  inodes: number;
  usedInodes: number;
}

interface TreeSize {
  /** Host-allocated bytes (tmpfs allocates in 4 KiB pages, close to ext4's blocks). */
  allocated: number;
  entries: number;
}

async function measureTree(dir: string): Promise<TreeSize> {
  const allocated = Number.parseInt(await capture(["du", "-s", "--block-size=1", dir]), 10);
  const entries = Number.parseInt(await capture(["sh", "-c", 'find "$1" -xdev | wc -l', "sh", dir]), 10);
  if (!Number.isFinite(allocated) || !Number.isFinite(entries)) throw new Error(`cannot measure ${dir}`);
  return { allocated, entries };
}

/** Inode numbers in use, from dumpe2fs's per-group free-inode ranges. */
export async function usedInodes(image: string): Promise<number[]> {
  const text = await capture(["dumpe2fs", image], { env: { ...process.env, LC_ALL: "C" } });
  const ipgMatch = /^Inodes per group:\s+(\d+)$/m.exec(text);
  const countMatch = /^Inode count:\s+(\d+)$/m.exec(text);
  if (!ipgMatch || !countMatch) throw new Error(`dumpe2fs ${image}: no inode geometry in its output`);
  const ipg = Number(ipgMatch[1]);
  const total = Number(countMatch[1]);
  const free = new Uint8Array(total + 1);
  let group = -1;
  for (const line of text.split("\n")) {
    const g = /^Group (\d+):/.exec(line);
    if (g) {
      group = Number(g[1]);
      continue;
    }
    const f = /^\s+Free inodes:\s*(.*)$/.exec(line);
    if (!f || group < 0) continue;
    for (const range of (f[1] ?? "").split(",").map((s) => s.trim()).filter(Boolean)) {
      const [a, b] = range.split("-").map(Number);
      if (a === undefined || !Number.isFinite(a)) continue;
      for (let i = a; i <= (b ?? a); i++) free[i] = 1;
    }
  }
  if (group < 0) throw new Error(`dumpe2fs ${image}: no group descriptors in its output`);
  const used: number[] = [];
  for (let i = 1; i <= total; i++) if (!free[i]) used.push(i);
  // Sanity: the root directory (inode 2) is always in use.
  if (!used.includes(2) || ipg <= 0) throw new Error(`dumpe2fs ${image}: implausible inode bitmap`);
  return used;
}

export async function makeReproducibleExt4(opts: Ext4Options): Promise<Ext4Result> {
  const log = opts.log ?? (() => undefined);
  const tree = await measureTree(opts.dir);
  // Room for every entry plus 25% (mkfs rounds per group), and space for the
  // data, directory blocks, inode tables and metadata with a margin; the
  // image is sparse, so slack costs nothing on the host.
  const inodes = Math.ceil(tree.entries * 1.25) + 1024;
  const bytes = tree.allocated * 1.1 + inodes * 256 + 64 * 1024 * 1024;
  const sizeMiB = Math.ceil(bytes / (1024 * 1024));
  log(`mkfs.ext4: ${tree.entries} entries, ${(tree.allocated / 1024 ** 2).toFixed(0)} MiB of data -> ${sizeMiB} MiB image, ${inodes} inodes`);

  const work = await mkdtemp(path.join(tmpdir(), "hutch-mke2fs-"));
  try {
    const conf = path.join(work, "mke2fs.conf");
    await writeFile(conf, MKE2FS_CONF);
    const env = {
      ...process.env,
      MKE2FS_CONFIG: conf,
      E2FSPROGS_FAKE_TIME: String(opts.epoch),
      SOURCE_DATE_EPOCH: String(opts.epoch),
      LC_ALL: "C",
    };
    await rm(opts.out, { force: true });
    await run(
      [
        "mke2fs", "-q", "-F",
        "-t", "ext4",
        "-b", "4096",
        "-I", "256",
        "-N", String(inodes),
        "-m", "0",
        "-U", opts.uuid,
        "-E", `hash_seed=${opts.uuid}`,
        "-L", opts.label,
        "-d", opts.dir,
        opts.out,
        `${sizeMiB}M`,
      ],
      { env },
    );

    // ctime (and atime, in case something read the tree after touch) of every inode -> epoch.
    const used = await usedInodes(opts.out);
    const cmds = used.map((i) => `sif <${i}> ctime @${opts.epoch}\nsif <${i}> atime @${opts.epoch}\n`).join("");
    const cmdFile = path.join(work, "times.debugfs");
    await writeFile(cmdFile, cmds);
    // debugfs exits 0 even when a command fails; its complaints go to stderr (after its banner).
    const complaints: string[] = [];
    await run(["debugfs", "-w", "-f", cmdFile, opts.out], {
      env,
      onLine: (line, stream) => {
        if (stream === "stderr" && line.trim() !== "" && !/^debugfs \d/.test(line)) complaints.push(line);
      },
    });
    if (complaints.length > 0) throw new Error(`debugfs time normalisation of ${opts.out} failed: ${complaints.slice(0, 5).join("; ")}`);

    // A full check: the image must be clean before anything boots it.
    await run(["e2fsck", "-f", "-n", opts.out], { env });
    const st = await stat(opts.out);
    return { sizeBytes: st.size, allocatedBytes: st.blocks * 512, inodes, usedInodes: used.length };
  } finally {
    await rm(work, { recursive: true, force: true });
  }
}
