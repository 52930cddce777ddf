/** Whether a pid names a live process (EPERM still means it exists). Used to sweep what dead brokers left. */
export function isAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'EPERM';
  }
}
