#!/usr/bin/env python3
"""The SM clock and board power while each benchmark row's timed runs ran.

Usage: clock-windows.py SMI_CSV ITERS RESULTS.json...

SMI_CSV: `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits
-lms 20` logged through the runs. Each row of the results files (lab/gemm-tiles.ts and the torch peer's
--grouped-gemm-only both record wall_end_s, when the timed runs ended) is matched with the samples in its
timed window, [wall_end_s - ITERS * us_median, wall_end_s]. Prints one line per row: the file, the case, the
median time, the median clock and power in the window, and time x clock (the work in clock cycles, which
compares two kernels across different clocks).
"""

import datetime
import json
import statistics
import sys


def read_samples(path):
    samples = []
    with open(path) as fh:
        for line in fh:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) < 4:
                continue
            try:
                t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                samples.append((t, float(parts[1]), float(parts[2]), float(parts[3])))
            except ValueError:
                continue  # a header or a line nvidia-smi could not fill
    return samples


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    samples = read_samples(argv[0])
    iters = int(argv[1])
    print(f"{'file':<34} {'case':<36} {'us':>9} {'MHz':>6} {'W':>6} {'C':>4} {'n':>3} {'us x GHz':>9}")
    for path in argv[2:]:
        with open(path) as fh:
            doc = json.load(fh)
        for row in doc["rows"]:
            end = row.get("wall_end_s")
            if end is None:
                continue
            start = end - iters * row["us_median"] * 1e-6
            window = [s for s in samples if start <= s[0] <= end]
            if not window:  # shorter than the log's period: the last sample before the end
                before = [s for s in samples if s[0] <= end]
                window = before[-1:]
            if not window:
                continue
            mhz = statistics.median(s[1] for s in window)
            watts = statistics.median(s[2] for s in window)
            temp = statistics.median(s[3] for s in window)
            case = f"{row['config']} M={row['m_per_group']} {row.get('tile') or row.get('impl', '')}"
            print(
                f"{path.split('/')[-1][:34]:<34} {case:<36} {row['us_median']:>9.1f} {mhz:>6.0f} {watts:>6.0f} "
                f"{temp:>4.0f} {len(window):>3} {row['us_median'] * mhz / 1000:>9.1f}"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
