/** The backends' names and the unsafe-local acknowledgement: what a command line may name, without loading a backend. */
export const BACKEND_NAMES = ['qemu', 'unsafe-local'] as const;

/** The flag that acknowledges what unsafe-local is; it must be given with `--backend unsafe-local`. */
export const UNSAFE_LOCAL_ACK_FLAG = '--i-know-unsafe-local';
