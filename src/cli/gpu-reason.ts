/** Why there is no GPU, in one line: the lookups' reasons list every folder searched, too long for a note. */

/**
 * `reason` (cudaAvailability's) in a few words when the driver library was not found: "no CUDA driver
 * found", followed by the dynamic loader's error when it was not a missing file (the folders searched
 * are left out). Other reasons (cuInit failed, no device) are returned unchanged.
 */
export function shortCudaReason(reason: string): string {
  if (!/; looked in: /.test(reason)) return reason;
  const loader = /; (dlopen\("[^"]+"\): [^;]*)$/.exec(reason)?.[1];
  return loader === undefined || /No such file or directory/.test(loader)
    ? "no CUDA driver found"
    : `no CUDA driver found; ${loader}`;
}

/**
 * The reason as a command says it: in full with `--verbose`, else short with `hint` (e.g. "--verbose
 * lists where it looked") when the short form left the folders out.
 */
export function cudaReasonText(reason: string, verbose: boolean | undefined, hint: string): string {
  const short = shortCudaReason(reason);
  return verbose === true || short === reason ? reason : `${short} (${hint})`;
}
