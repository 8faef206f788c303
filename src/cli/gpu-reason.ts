/** Why there is no GPU, in one line: the lookups' reasons list every folder searched, too long for a note. */

/**
 * `reason` (cudaAvailability's) with its "looked in: <folders>" list replaced by the folders' count,
 * and a dynamic-loader miss said in words. Other reasons are returned unchanged.
 */
export function shortCudaReason(reason: string): string {
  const looked = /; looked in: ([^;]*)/.exec(reason);
  if (looked === null) return reason;
  const folders = looked[1]!.split(", ").length;
  return reason
    .replace(looked[0], ` in ${folders} folder${folders === 1 ? "" : "s"}`)
    .replace(/; dlopen\("[^"]+"\): [^;]*No such file or directory/, ", nor by the dynamic loader");
}
