import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { decadeLabel, decadeRange, type PlotRow, plotTitle, renderTimePlot } from "../../src/cli/plot.js";
import { rng, testSeed } from "../helpers/random.js";

const seed = testSeed("plot");

/** A sweep like the bench's: unfused eager and graph, torch, each with noise; floors on ours. */
function sweepRows(random: () => number): PlotRow[] {
  const rows: PlotRow[] = [];
  for (let i = 0; i < 14; i++) {
    const tokens = 2 ** i;
    const floor = 40 + 0.25 * tokens * (0.9 + 0.2 * random());
    rows.push({
      impl: "unfused",
      tokens,
      us_median: floor * (1.2 + random()),
      floor_us: floor,
      graph: false,
    });
    rows.push({ impl: "unfused", tokens, us_median: floor * (1.1 + random()), floor_us: floor, graph: true });
    rows.push({ impl: "torch", tokens, us_median: 200 + tokens * (1 + random()), floor_us: 0 });
  }
  // Out of order on purpose: the plot must sort by tokens.
  return rows.sort(() => random() - 0.5);
}

interface Tag {
  name: string;
  attrs: Record<string, string>;
}

/** A small XML check: every tag closes in order, attributes are quoted; returns the opening tags. */
function parseSvg(svg: string): Tag[] {
  const tags: Tag[] = [];
  const stack: string[] = [];
  const re = /<(\/?)([a-zA-Z][\w:-]*)((?:\s+[\w:-]+="[^"<]*")*)\s*(\/?)>/g;
  let last = 0;
  for (let m = re.exec(svg); m !== null; m = re.exec(svg)) {
    const between = svg.slice(last, m.index);
    assert.ok(!/[<>]/.test(between), `stray markup before ${m[0]}: ${between.slice(0, 60)}`);
    assert.ok(!/&(?!#\d+;|amp;|lt;|gt;|quot;)/.test(between), `unescaped & in text: ${between}`);
    last = re.lastIndex;
    const [, closing, name, attrText, selfClosing] = m;
    if (closing) {
      assert.equal(stack.pop(), name, `</${name}> closes the wrong element`);
      continue;
    }
    const attrs: Record<string, string> = {};
    for (const a of attrText!.matchAll(/([\w:-]+)="([^"]*)"/g)) attrs[a[1]!] = a[2]!;
    tags.push({ name: name!, attrs });
    if (!selfClosing) stack.push(name!);
  }
  assert.equal(svg.slice(last).trim(), "", "text after the root element");
  assert.deepEqual(stack, [], "unclosed elements");
  return tags;
}

function pathPoints(d: string): { x: number; y: number }[] {
  const pts: { x: number; y: number }[] = [];
  for (const m of d.matchAll(/([ML])(-?[\d.]+) (-?[\d.]+)/g)) pts.push({ x: Number(m[2]), y: Number(m[3]) });
  assert.match(d, /^M/);
  return pts;
}

describe("renderTimePlot", () => {
  it("is one well-formed SVG root of 800×500 with one path per series and a dashed floor", () => {
    const svg = renderTimePlot(sweepRows(rng(seed)), { title: "flash-ep8 · shared expert on · H200" });
    const tags = parseSvg(svg);
    assert.ok(svg.startsWith("<svg "));
    assert.equal(tags[0]!.name, "svg");
    assert.equal(tags[0]!.attrs.xmlns, "http://www.w3.org/2000/svg");
    assert.equal(tags[0]!.attrs.viewBox, "0 0 800 500");
    const series = tags.filter((t) => t.name === "path" && t.attrs.class === "series");
    assert.deepEqual(series.map((t) => t.attrs["data-series"]).sort(), [
      "torch",
      "unfused",
      "unfused (graph)",
    ]);
    const floors = tags.filter((t) => t.name === "path" && t.attrs.class === "floor");
    assert.equal(floors.length, 1);
    assert.ok(floors[0]!.attrs["stroke-dasharray"]);
    assert.equal(tags.filter((t) => t.name === "path").length, 4);
    for (const p of [...series, ...floors]) {
      const pts = pathPoints(p.attrs.d!);
      assert.equal(pts.length, 14);
      for (let i = 0; i < pts.length; i++) {
        const { x, y } = pts[i]!;
        assert.ok(x >= 0 && x <= 800 && y >= 0 && y <= 500, `point (${x}, ${y}) outside the view box`);
        if (i > 0) assert.ok(x > pts[i - 1]!.x, "x must increase along a series");
      }
    }
    // 14 markers per series, the legend has its entries.
    assert.equal(tags.filter((t) => t.attrs.class === "marker").length, 3 * 14 + 3);
    for (const label of ["torch", "unfused (graph)", "floor", "tokens"])
      assert.ok(svg.includes(`>${label}<`));
    assert.ok(svg.includes("flash-ep8 · shared expert on · H200"));
  });

  it("puts values on a log scale: decades equally spaced, on their tick labels", () => {
    const rows: PlotRow[] = [1, 10, 100, 1000].map((tokens) => ({
      impl: "unfused",
      tokens,
      us_median: 10 * tokens,
    }));
    rows.push({ impl: "torch", tokens: 2, us_median: 20 * Math.sqrt(10) });
    const tags = parseSvg(renderTimePlot(rows, { title: "log" }));
    const [ours, torch] = tags.filter((t) => t.attrs.class === "series").map((t) => pathPoints(t.attrs.d!));
    const dx = ours!.map((p, i) => (i === 0 ? 0 : p.x - ours![i - 1]!.x)).slice(1);
    const dy = ours!.map((p, i) => (i === 0 ? 0 : p.y - ours![i - 1]!.y)).slice(1);
    for (const d of dx) assert.ok(Math.abs(d - dx[0]!) <= 0.2, `decades not equally spaced in x: ${dx}`);
    for (const d of dy) assert.ok(Math.abs(d - dy[0]!) <= 0.2, `decades not equally spaced in y: ${dy}`);
    assert.ok(dx[0]! > 0 && dy[0]! < 0, "time grows upwards, tokens to the right");
    // Each point sits on its decade's tick: x ticks 1, 10, 100, 1k; y ticks 10, 100, 1k, 10k.
    const xTicks = tags.filter((t) => t.attrs.class === "tick x").map((t) => Number(t.attrs.x));
    const yTicks = tags.filter((t) => t.attrs.class === "tick y").map((t) => Number(t.attrs.y));
    assert.equal(xTicks.length, 4);
    assert.equal(yTicks.length, 4);
    ours!.forEach((p, i) => {
      assert.ok(Math.abs(p.x - xTicks[i]!) <= 0.1, `x of 10^${i} is ${p.x}, tick at ${xTicks[i]}`);
      assert.ok(Math.abs(p.y - yTicks[i]!) <= 0.1, `y of 10^${i + 1} is ${p.y}, tick at ${yTicks[i]}`);
    });
    // tokens = 2 lies log10(2) of a decade right of 1; 20·√10 µs lies 1.8 decades above 10 µs.
    const t = torch![0]!;
    assert.ok(Math.abs(t.x - (xTicks[0]! + Math.log10(2) * dx[0]!)) <= 0.15, `x of 2 tokens: ${t.x}`);
    assert.ok(Math.abs(t.y - (yTicks[0]! + (Math.log10(2) + 0.5) * dy[0]!)) <= 0.15, `y: ${t.y}`);
  });

  it("escapes the title and labels, skips non-positive values, and draws an empty plot without data", () => {
    const svg = renderTimePlot(
      [
        { impl: "a<b>&c", tokens: 4, us_median: 5 },
        { impl: "a<b>&c", tokens: 8, us_median: 0 },
        { impl: "bad", tokens: 0, us_median: 3 },
      ],
      { title: 'x < y & "z"' },
    );
    const tags = parseSvg(svg);
    assert.ok(svg.includes("x &#60; y &#38; &#34;z&#34;"));
    const series = tags.filter((t) => t.attrs.class === "series");
    assert.equal(series.length, 1);
    assert.equal(pathPoints(series[0]!.attrs.d!).length, 1);
    const empty = renderTimePlot([], { title: "nothing" });
    parseSvg(empty);
    assert.ok(empty.includes(">no data<"));
  });
});

describe("plot helpers", () => {
  it("labels decades", () => {
    assert.deepEqual([-2, -1, 0, 1, 2, 3, 4, 5, 6].map(decadeLabel), [
      "0.01",
      "0.1",
      "1",
      "10",
      "100",
      "1k",
      "10k",
      "100k",
      "1M",
    ]);
  });

  it("covers values with whole decades, exact decades on their own tick", () => {
    assert.deepEqual(decadeRange([1, 8192]), [0, 4]);
    assert.deepEqual(decadeRange([1000, 1000]), [3, 4]);
    assert.deepEqual(decadeRange([0.5, 45, 10532]), [-1, 5]);
  });

  it("titles name the shape, the shared expert and the device", () => {
    assert.equal(plotTitle("flash", true, { name: "NVIDIA H200" }), "flash · shared expert on · NVIDIA H200");
    assert.equal(plotTitle("tiny", false, undefined), "tiny · shared expert off");
  });
});
