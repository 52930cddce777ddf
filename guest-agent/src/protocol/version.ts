/** Bumped on any incompatible change to frames, envelopes or method schemas. */
export const PROTOCOL_VERSION = 1;

/** Defaults both sides announce in `hello`; each side sends within the *peer's* limits. */
export const DEFAULT_MAX_FRAME_BYTES = 1024 * 1024;
export const DEFAULT_STREAM_WINDOW_BYTES = 512 * 1024;
/** Largest data payload per frame: small enough that control frames never wait long behind data. */
export const MAX_DATA_CHUNK_BYTES = 128 * 1024;
