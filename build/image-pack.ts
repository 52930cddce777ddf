/**
 * Pack a staging directory into the two image formats a guest boots from:
 * a gzip'd newc cpio (initramfs) and an ext4 filesystem image.
 *
 * Both run as root on the host so device nodes and ownership in the staging
 * dir are kept as they are (hutch's builders run as root; see DEVELOPERS.md).
 */
import { rm } from "node:fs/promises";
import { run } from "./run.ts";

/** `dir` -> gzip'd newc cpio at `out`, every file owned by root. */
export async function packInitramfs(dir: string, out: string): Promise<void> {
  await rm(out, { force: true });
  // A pipeline is the natural shape here; paths are passed as positional
  // arguments ($1, $2), never interpolated into the script.
  await run(["sh", "-c", 'cd "$1" && find . -print0 | LC_ALL=C sort -z | cpio --null --create --format=newc --owner=0:0 --quiet | gzip -9n > "$2"', "sh", dir, out]);
}

/**
 * `dir` -> ext4 image at `out` of `sizeMiB` (mke2fs -d copies the tree in,
 * no loop mount needed). `label` becomes the filesystem label.
 */
export async function packExt4(dir: string, out: string, sizeMiB: number, label = "hutch"): Promise<void> {
  await rm(out, { force: true });
  await run(["mkfs.ext4", "-q", "-F", "-L", label, "-E", "root_owner=0:0", "-d", dir, out, `${sizeMiB}M`]);
}
