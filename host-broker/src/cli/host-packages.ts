/**
 * In a clone, `./hutch` asks (HUTCH_INSTALL_PACKAGES=1) for the Debian packages hutch uses
 * to be installed before a command runs, once its options are known to be good: a mistyped
 * option is refused at once, never after an apt-get. The installed package's CLI does not.
 */
export async function installPackagesForClone(log: (m: string) => void = (m) => process.stderr.write(`hutch: ${m}\n`)): Promise<void> {
  if (process.env['HUTCH_INSTALL_PACKAGES'] !== '1') return;
  const { installHostPackages } = await import('../../../build/host-packages.ts');
  await installHostPackages(log);
}
