import { z } from 'zod';

/**
 * Every failure that crosses the wire carries one of these codes, so a harness can
 * branch on `err.code` instead of parsing messages (undici-style explicit errors).
 */
export const ERROR_CODES = [
  'bad_request', // malformed frame or message, params that fail validation
  'unauthorized', // missing or wrong token
  'not_found', // path, session, stream or method does not exist
  'already_exists',
  'not_a_directory',
  'is_a_directory',
  'not_empty',
  'outside_workspace', // a path (or a symlink on it) resolves outside the workspace root
  'permission_denied',
  'no_space', // ENOSPC / EDQUOT: the disk filled; nothing was half-written
  'quota_exceeded', // the session's workspace quota (bytes or files) is used up; context.limit names which
  'binary_file', // a text tool was asked to read a binary file
  'no_match', // edit: oldString occurs 0 times
  'multiple_matches', // edit: oldString occurs N > 1 times without replaceAll
  'timeout',
  'too_large', // frame, file or output above its limit
  'unsupported_file_type', // a FIFO, socket or device node: sync carries files, directories and symlinks only
  'invalid_name', // a file name this side cannot create (too long, or not a valid path component)
  'busy', // a resource is at capacity; retry later
  'cancelled',
  'flow_control', // the peer sent more than its stream credit allowed
  'unsupported_version',
  'connection_closed', // the channel to the agent closed while a call was in flight
  'guest_crashed', // the VM behind the channel died
  'guest_unresponsive', // the guest did not answer an RPC within its deadline; its VM was torn down
  'interrupted', // the channel to the guest was reset while the call was in flight: it may or may not have run
  'stale_epoch', // a frame of an earlier connection epoch reached a newer one (the peer re-handshakes)
  'connection_refused', // nothing listens on that port in the sandbox (a harness reaching a sandbox's port)
  'unavailable', // a feature this host or kernel cannot provide
  'unusable_rootfs', // a template's root filesystem lacks what hutch needs (context.missing names it)
  'internal',
] as const;

export type ErrorCode = (typeof ERROR_CODES)[number];
export const ErrorCodeSchema = z.enum(ERROR_CODES);

export const WireErrorSchema = z.object({
  code: ErrorCodeSchema,
  message: z.string(),
  context: z.record(z.string(), z.unknown()).optional(),
});
export type WireError = z.infer<typeof WireErrorSchema>;

export class HutchError extends Error {
  readonly code: ErrorCode;
  readonly context: Record<string, unknown> | undefined;

  constructor(code: ErrorCode, message: string, context?: Record<string, unknown>, options?: { cause?: unknown }) {
    super(message, options);
    this.name = 'HutchError';
    this.code = code;
    this.context = context;
  }

  toWire(): WireError {
    return this.context === undefined
      ? { code: this.code, message: this.message }
      : { code: this.code, message: this.message, context: this.context };
  }

  static fromWire(w: WireError): HutchError {
    return new HutchError(w.code, w.message, w.context);
  }
}

const ERRNO_TO_CODE: Record<string, ErrorCode> = {
  ENOENT: 'not_found',
  EEXIST: 'already_exists',
  ENOTDIR: 'not_a_directory',
  EISDIR: 'is_a_directory',
  ENOTEMPTY: 'not_empty',
  EACCES: 'permission_denied',
  EPERM: 'permission_denied',
  EROFS: 'permission_denied',
  ENOSPC: 'no_space',
  EDQUOT: 'no_space',
  EFBIG: 'too_large',
  ELOOP: 'outside_workspace',
  ENAMETOOLONG: 'bad_request',
  EINVAL: 'bad_request',
};

/**
 * Turns anything thrown into a HutchError. Node errno errors keep their syscall and
 * errno as context; the workspace-relative path is supplied by the caller because the
 * raw error would leak the host path of the workspace.
 */
export function toHutchError(err: unknown, context?: Record<string, unknown>): HutchError {
  if (err instanceof HutchError) return err;
  const e = err as NodeJS.ErrnoException | undefined;
  if (e && typeof e.code === 'string' && e.code in ERRNO_TO_CODE) {
    const code = ERRNO_TO_CODE[e.code] as ErrorCode;
    return new HutchError(code, describeErrno(e.code, context), { ...context, errno: e.code, syscall: e.syscall });
  }
  const message = err instanceof Error ? err.message : String(err);
  return new HutchError('internal', message, context, { cause: err });
}

function describeErrno(errno: string, context?: Record<string, unknown>): string {
  const where = typeof context?.['path'] === 'string' ? `: ${context['path']}` : '';
  switch (errno) {
    case 'ENOENT': return `no such file or directory${where}`;
    case 'EEXIST': return `already exists${where}`;
    case 'ENOTDIR': return `not a directory${where}`;
    case 'EISDIR': return `is a directory${where}`;
    case 'ENOTEMPTY': return `directory not empty${where}`;
    case 'EACCES': case 'EPERM': case 'EROFS': return `permission denied${where}`;
    case 'ENOSPC': case 'EDQUOT': return `no space left on device${where}`;
    case 'ELOOP': return `too many levels of symbolic links${where}`;
    default: return `${errno}${where}`;
  }
}
