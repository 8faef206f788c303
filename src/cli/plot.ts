/**
 * Time-versus-tokens plots of benchmark results as standalone SVG, written by hand (no plotting
 * package): log-log axes with decade ticks, one line with markers per implementation (CUDA-graph
 * timings as their own dotted series), the roofline floor dashed, a legend and a title.
 */
import fs from "node:fs";
import path from "node:path";
import { parsePeerResults } from "../bench/peer.js";
import type { ResultRow } from "../cuda/index.js";
import { makeDirectory } from "../cuda/mkdir.js";
import { type OverwriteOption, targetFileProblem, writeFileAside } from "../io/write-aside.js";
import { checkInputFile, checkOutputFile, sameFile, UsageError } from "./usage.js";

/** The fields of a results row the plot reads. */
export type PlotRow = Pick<ResultRow, "impl" | "tokens" | "us_median"> & {
  floor_us?: number;
  graph?: unknown;
};

export interface PlotOptions {
  title: string;
  /** Pixels (default 800 × 500). */
  width?: number;
  height?: number;
}

const MARGIN = { left: 78, right: 24, top: 48, bottom: 58 };
const FONT = 'font-family="Helvetica, Arial, sans-serif"';
const KNOWN_COLORS: Record<string, string> = {
  unfused: "#1f77b4",
  fused: "#2ca02c",
  torch: "#ff7f0e",
  "torch-loop": "#d62728",
};
const PALETTE = ["#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"];
const FLOOR_COLOR = "#555555";

/** The series a row belongs to: its implementation, with " (graph)" for CUDA-graph timings. */
export function seriesLabel(row: PlotRow): string {
  return row.graph === true ? `${row.impl} (graph)` : row.impl;
}

function escapeXml(s: string): string {
  return s.replace(/[<>&"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

/** "1", "10", "100", "1k", …, "0.1": the label of the decade 10^n. */
export function decadeLabel(n: number): string {
  if (n < 0) return (10 ** n).toFixed(-n);
  const units = ["", "k", "M", "G", "T"];
  const unit = Math.min(Math.floor(n / 3), units.length - 1);
  return `${10 ** (n - 3 * unit)}${units[unit]}`;
}

/** Whole decades [lo, hi] (lo < hi) covering every value (all positive). */
export function decadeRange(values: readonly number[]): [number, number] {
  if (values.length === 0) return [0, 1];
  // The tolerance keeps exact decades (log10(1000) = 2.9999999999999996) on their own tick.
  const lo = Math.floor(Math.log10(Math.min(...values)) + 1e-9);
  const hi = Math.ceil(Math.log10(Math.max(...values)) - 1e-9);
  return [lo, Math.max(hi, lo + 1)];
}

/** One axis: value → pixel on a log scale between two pixel positions. */
export function logScale(decades: [number, number], from: number, to: number): (v: number) => number {
  const [lo, hi] = decades;
  return (v) => from + ((Math.log10(v) - lo) / (hi - lo)) * (to - from);
}

const px = (v: number) => (Math.round(v * 10) / 10).toString();

interface Series {
  label: string;
  graph: boolean;
  color: string;
  points: { tokens: number; us: number }[];
}

function plotSeries(rows: readonly PlotRow[]): Series[] {
  const byLabel = new Map<string, Series>();
  let nextColor = 0;
  const colorOf = new Map<string, string>();
  for (const r of rows) {
    if (!(r.tokens > 0 && r.us_median > 0 && Number.isFinite(r.us_median))) continue;
    const label = seriesLabel(r);
    let s = byLabel.get(label);
    if (!s) {
      let color = colorOf.get(r.impl) ?? KNOWN_COLORS[r.impl];
      if (color === undefined) color = PALETTE[nextColor++ % PALETTE.length]!;
      colorOf.set(r.impl, color);
      s = { label, graph: r.graph === true, color, points: [] };
      byLabel.set(label, s);
    }
    // One point per token count (the first row given wins).
    if (!s.points.some((p) => p.tokens === r.tokens)) s.points.push({ tokens: r.tokens, us: r.us_median });
  }
  for (const s of byLabel.values()) s.points.sort((a, b) => a.tokens - b.tokens);
  return [...byLabel.values()];
}

/** The floor per token count: the first positive `floor_us` given for it. */
function floorPoints(rows: readonly PlotRow[]): { tokens: number; us: number }[] {
  const floor = new Map<number, number>();
  for (const r of rows) {
    const f = r.floor_us;
    if (r.tokens > 0 && typeof f === "number" && f > 0 && Number.isFinite(f) && !floor.has(r.tokens)) {
      floor.set(r.tokens, f);
    }
  }
  return [...floor.entries()].map(([tokens, us]) => ({ tokens, us })).sort((a, b) => a.tokens - b.tokens);
}

function pathData(points: { x: number; y: number }[]): string {
  return points.map((p, i) => `${i === 0 ? "M" : "L"}${px(p.x)} ${px(p.y)}`).join(" ");
}

/**
 * An SVG document (width × height, default 800 × 500) plotting µs (median) against tokens on log-log
 * axes: one `<path class="series">` with markers per series (impl, and impl + " (graph)" for rows with
 * `graph: true`), the floor as a dashed `<path class="floor">`, a legend and `title`.
 */
export function renderTimePlot(rows: readonly PlotRow[], options: PlotOptions): string {
  const width = options.width ?? 800;
  const height = options.height ?? 500;
  const left = MARGIN.left;
  const right = width - MARGIN.right;
  const top = MARGIN.top;
  const bottom = height - MARGIN.bottom;
  const series = plotSeries(rows);
  const floor = floorPoints(rows);
  const xs = [...series.flatMap((s) => s.points.map((p) => p.tokens)), ...floor.map((p) => p.tokens)];
  const ys = [...series.flatMap((s) => s.points.map((p) => p.us)), ...floor.map((p) => p.us)];
  const xDecades = decadeRange(xs);
  const yDecades = decadeRange(ys);
  const x = logScale(xDecades, left, right);
  const y = logScale(yDecades, bottom, top);

  const out: string[] = [];
  out.push(
    `<svg xmlns="http://www.w3.org/2000/svg" width="${width}" height="${height}" viewBox="0 0 ${width} ${height}">`,
  );
  out.push(`<rect x="0" y="0" width="${width}" height="${height}" fill="#ffffff"/>`);
  out.push(
    `<text x="${px(width / 2)}" y="28" text-anchor="middle" font-size="16" font-weight="bold" ${FONT}>${escapeXml(options.title)}</text>`,
  );

  // Grid: decades solid, the 2…9 in between faint.
  const grid: string[] = [];
  const labels: string[] = [];
  for (let n = xDecades[0]; n <= xDecades[1]; n++) {
    const gx = px(x(10 ** n));
    grid.push(
      `<line class="grid major" x1="${gx}" y1="${px(top)}" x2="${gx}" y2="${px(bottom)}" stroke="#d0d0d0"/>`,
    );
    labels.push(
      `<text class="tick x" x="${gx}" y="${px(bottom + 18)}" text-anchor="middle" font-size="12" ${FONT}>${decadeLabel(n)}</text>`,
    );
    for (let m = 2; m <= 9 && n < xDecades[1]; m++) {
      const mx = px(x(m * 10 ** n));
      grid.push(
        `<line class="grid minor" x1="${mx}" y1="${px(top)}" x2="${mx}" y2="${px(bottom)}" stroke="#f0f0f0"/>`,
      );
    }
  }
  for (let n = yDecades[0]; n <= yDecades[1]; n++) {
    const gy = px(y(10 ** n));
    grid.push(
      `<line class="grid major" x1="${px(left)}" y1="${gy}" x2="${px(right)}" y2="${gy}" stroke="#d0d0d0"/>`,
    );
    labels.push(
      `<text class="tick y" x="${px(left - 8)}" y="${gy}" text-anchor="end" dominant-baseline="middle" font-size="12" ${FONT}>${decadeLabel(n)}</text>`,
    );
    for (let m = 2; m <= 9 && n < yDecades[1]; m++) {
      const my = px(y(m * 10 ** n));
      grid.push(
        `<line class="grid minor" x1="${px(left)}" y1="${my}" x2="${px(right)}" y2="${my}" stroke="#f0f0f0"/>`,
      );
    }
  }
  // Minor lines first so the decade lines draw over them.
  grid.sort((a, b) => Number(a.includes("major")) - Number(b.includes("major")));
  out.push(...grid);
  out.push(
    `<rect x="${px(left)}" y="${px(top)}" width="${px(right - left)}" height="${px(bottom - top)}" fill="none" stroke="#333333"/>`,
  );
  out.push(...labels);
  out.push(
    `<text x="${px((left + right) / 2)}" y="${px(height - 14)}" text-anchor="middle" font-size="13" ${FONT}>tokens</text>`,
  );
  out.push(
    `<text x="18" y="${px((top + bottom) / 2)}" text-anchor="middle" font-size="13" transform="rotate(-90 18 ${px((top + bottom) / 2)})" ${FONT}>time (µs, median)</text>`,
  );

  if (floor.length > 0) {
    const d = pathData(floor.map((p) => ({ x: x(p.tokens), y: y(p.us) })));
    out.push(
      `<path class="floor" d="${d}" fill="none" stroke="${FLOOR_COLOR}" stroke-width="1.5" stroke-dasharray="6 4"/>`,
    );
  }
  for (const s of series) {
    const pts = s.points.map((p) => ({ x: x(p.tokens), y: y(p.us), ...p }));
    const dash = s.graph ? ' stroke-dasharray="2 3"' : "";
    out.push(
      `<path class="series" data-series="${escapeXml(s.label)}" d="${pathData(pts)}" fill="none" stroke="${s.color}" stroke-width="2"${dash}/>`,
    );
    for (const p of pts) {
      const tip = `<title>${escapeXml(s.label)}, ${p.tokens} tokens: ${p.us.toFixed(1)} µs</title>`;
      out.push(marker(s, p.x, p.y, tip));
    }
  }

  // Legend, top left inside the plot (small T at large times is usually empty).
  const entries = [
    ...series.map((s) => ({ label: s.label, s })),
    ...(floor.length > 0 ? [{ label: "floor", s: null }] : []),
  ];
  if (entries.length > 0) {
    const lx = left + 10;
    const ly = top + 10;
    const boxWidth = 44 + 7.2 * Math.max(...entries.map((e) => e.label.length));
    out.push(
      `<rect class="legend" x="${px(lx)}" y="${px(ly)}" width="${px(boxWidth)}" height="${px(8 + 18 * entries.length)}" fill="#ffffff" fill-opacity="0.9" stroke="#bbbbbb"/>`,
    );
    entries.forEach((e, i) => {
      const cy = ly + 13 + 18 * i;
      if (e.s === null) {
        out.push(
          `<line x1="${px(lx + 8)}" y1="${px(cy)}" x2="${px(lx + 32)}" y2="${px(cy)}" stroke="${FLOOR_COLOR}" stroke-width="1.5" stroke-dasharray="6 4"/>`,
        );
      } else {
        const dash = e.s.graph ? ' stroke-dasharray="2 3"' : "";
        out.push(
          `<line x1="${px(lx + 8)}" y1="${px(cy)}" x2="${px(lx + 32)}" y2="${px(cy)}" stroke="${e.s.color}" stroke-width="2"${dash}/>`,
        );
        out.push(marker(e.s, lx + 20, cy, ""));
      }
      out.push(
        `<text x="${px(lx + 38)}" y="${px(cy)}" dominant-baseline="middle" font-size="12" ${FONT}>${escapeXml(e.label)}</text>`,
      );
    });
  }
  if (series.length === 0 && floor.length === 0) {
    out.push(
      `<text x="${px((left + right) / 2)}" y="${px((top + bottom) / 2)}" text-anchor="middle" font-size="14" ${FONT}>no data</text>`,
    );
  }
  out.push("</svg>");
  return `${out.join("\n")}\n`;
}

/** Circles for eager timings, squares for CUDA-graph ones. */
function marker(s: Series, cx: number, cy: number, tip: string): string {
  if (s.graph) {
    return `<rect class="marker" x="${px(cx - 3.5)}" y="${px(cy - 3.5)}" width="7" height="7" fill="${s.color}">${tip}</rect>`;
  }
  return `<circle class="marker" cx="${px(cx)}" cy="${px(cy)}" r="3.5" fill="${s.color}">${tip}</circle>`;
}

/** "flash-ep8 · shared expert on · NVIDIA H200". */
export function plotTitle(config: string, shared: boolean | undefined, device: unknown): string {
  const parts = [config];
  if (shared !== undefined) parts.push(`shared expert ${shared ? "on" : "off"}`);
  const name =
    typeof device === "string"
      ? device
      : typeof device === "object" &&
          device !== null &&
          typeof (device as { name?: unknown }).name === "string"
        ? (device as { name: string }).name
        : undefined;
  if (name !== undefined) parts.push(name);
  return parts.join(" · ");
}

/**
 * Writes `svg` to `file` (folders created) through a temporary name (writeAside); an existing file is
 * refused unless `overwrite` (the command's --force) is on.
 */
export function writePlot(file: string, svg: string, opts: OverwriteOption = {}): void {
  const problem = targetFileProblem(file, opts.overwrite === true, "pass --force");
  if (problem !== null) throw new UsageError(problem);
  makeDirectory(path.dirname(path.resolve(file)));
  writeFileAside(file, svg);
}

export interface PlotCommandOptions {
  out: string;
  shape?: string;
  shared?: boolean;
  title?: string;
  /** Overwrite an existing --out file. */
  force?: boolean;
}

/** `megamoe plot <results.json…>`: one plot of the layer rows of several results files. */
export function runPlot(files: readonly string[], opts: PlotCommandOptions): void {
  if (files.length === 0) throw new UsageError("plot: give at least one results file");
  for (const f of files) checkInputFile("plot", f);
  // The SVG written over a results file would destroy the data it was drawn from (even with --force).
  const input = files.find((f) => sameFile(f, opts.out));
  if (input !== undefined) {
    throw new UsageError(
      `--out ${opts.out}: is the results file ${input} being plotted; write the SVG elsewhere`,
    );
  }
  checkOutputFile("--out", opts.out, opts.force);
  const docs = files.map((f) => parsePeerResults(fs.readFileSync(f, "utf8"), f));
  const empty = docs.find((d) => d.rows.length === 0);
  if (empty !== undefined) throw new UsageError(`plot: ${empty.file} holds no rows`);
  let rows = docs.flatMap((d) => d.rows);
  if (opts.shape !== undefined) rows = rows.filter((r) => r.config === opts.shape);
  if (opts.shared !== undefined) rows = rows.filter((r) => r.shared === opts.shared);
  const configs = [...new Set(rows.map((r) => r.config))];
  if (configs.length === 0) throw new UsageError("plot: no rows left to plot (check --shape and --shared)");
  if (configs.length > 1) {
    throw new UsageError(
      `plot: the rows hold several shapes (${configs.join(", ")}); choose one with --shape`,
    );
  }
  const shareds = [...new Set(rows.map((r) => r.shared))];
  const title =
    opts.title ?? plotTitle(configs[0]!, shareds.length === 1 ? shareds[0] : undefined, docs[0]!.device);
  writePlot(opts.out, renderTimePlot(rows, { title }), { overwrite: opts.force === true });
  process.stdout.write(`plot written to ${opts.out} (${rows.length} rows)\n`);
}
