/**
 * Progress of long CPU or GPU work: a bar on a terminal; elsewhere (a pipe, a CI log) a plain line every
 * few seconds, so work that lasts minutes is never silent, and work shorter than the interval prints
 * nothing.
 */
import cliProgress from "cli-progress";

export interface Progress {
  /** `note`: a short status after the counts (e.g. "2 failed"). */
  update(done: number, total: number, note?: string): void;
  stop(): void;
}

/** Where and how often: tests replace the stream and the clock. */
export interface ProgressOptions {
  /** Default process.stderr: stdout may carry --json. */
  stream?: NodeJS.WritableStream & { isTTY?: boolean };
  /** Seconds between plain lines (default 5). */
  intervalSeconds?: number;
  /** Milliseconds, monotonic (default performance.now). */
  now?: () => number;
}

export function progressBar(label: string, options: ProgressOptions = {}): Progress {
  const stream = options.stream ?? process.stderr;
  return stream.isTTY === true
    ? terminalBar(label, stream)
    : plainLines(label, stream, options.intervalSeconds ?? 5, options.now ?? (() => performance.now()));
}

function terminalBar(label: string, stream: NodeJS.WritableStream): Progress {
  const bar = new cliProgress.SingleBar(
    {
      format: `${label} [{bar}] {value}/{total}{note} | {duration_formatted} elapsed, eta {eta_formatted}`,
      stream,
      hideCursor: true,
      clearOnComplete: true,
    },
    cliProgress.Presets.shades_classic,
  );
  let started = false;
  return {
    update(done, total, note) {
      const payload = { note: note === undefined ? "" : `, ${note}` };
      if (!started) {
        bar.start(total, done, payload);
        started = true;
      } else {
        bar.setTotal(total);
        bar.update(done, payload);
      }
    },
    stop() {
      if (started) bar.stop();
    },
  };
}

/**
 * `label: done/total[, note], N s elapsed` once `intervalSeconds` have passed since the start or the
 * last line, checked on each update (synchronous work blocks timers) and by a timer (asynchronous work
 * may go long between updates); and a last line at stop when any line was printed.
 */
function plainLines(
  label: string,
  stream: NodeJS.WritableStream,
  intervalSeconds: number,
  now: () => number,
): Progress {
  const started = now();
  let last = started;
  let printed = false;
  let state: { done: number; total: number; note?: string } | undefined;
  const line = (suffix: string) => {
    if (state === undefined) return;
    const seconds = ((now() - started) / 1000).toFixed(0);
    const note = state.note === undefined ? "" : `, ${state.note}`;
    stream.write(`${label}: ${state.done}/${state.total}${note}, ${seconds} s ${suffix}\n`);
    printed = true;
  };
  const printIfDue = () => {
    if (now() - last < intervalSeconds * 1000) return;
    last = now();
    line("elapsed");
  };
  const timer = setInterval(printIfDue, intervalSeconds * 1000);
  timer.unref();
  return {
    update(done, total, note) {
      state = { done, total, note };
      printIfDue();
    },
    stop() {
      clearInterval(timer);
      if (printed) line("in all");
    },
  };
}
