/** An answer of the E2B control plane: the HTTP status and E2B's `{ code, message }` body. */
export class ApiError extends Error {
  constructor(
    readonly status: number,
    message: string,
  ) {
    super(message);
  }
}
