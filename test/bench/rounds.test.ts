import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { type RoundsMeasurement, timeInRounds } from "../../src/bench/rounds.js";

interface Fake extends RoundsMeasurement {
  name: string;
  failInRound?: number;
}

const fake = (name: string, graph: boolean, warmup: number, failInRound?: number): Fake => ({
  name,
  graph,
  warmup,
  samples: [],
  failInRound,
});

describe("timeInRounds", () => {
  test("every round times every measurement in turn; warm-ups only in full before the first", () => {
    const a = fake("a", false, 5);
    const b = fake("b", true, 3);
    const calls: string[] = [];
    let round = 0;
    timeInRounds([a, b], 3, 20, (m, warmup, runs) => {
      calls.push(`${m.name} w${warmup} n${runs}`);
      if (m === b) round++;
      return Array.from({ length: runs }, () => round);
    });
    // ceil(20 / 3) = 7 runs per round: 21 samples each, a drift (the round number) spread over both.
    assert.deepEqual(calls, ["a w5 n7", "b w3 n7", "a w1 n7", "b w1 n7", "a w1 n7", "b w1 n7"]);
    assert.equal(a.samples.length, 21);
    assert.deepEqual([...new Set(b.samples)], [1, 2, 3], "b's samples come from every round");
  });

  test("a failed graph measurement is recorded and skipped; an eager failure is thrown", () => {
    const eager = fake("eager", false, 1);
    const graph = fake("graph", true, 1);
    const seen: string[] = [];
    timeInRounds([eager, graph], 2, 20, (m) => {
      seen.push(m.name);
      if (m === graph) throw new Error("capture failed\nsecond line");
      return [1];
    });
    assert.equal(graph.error, "capture failed");
    assert.deepEqual(seen, ["eager", "graph", "eager"]);
    assert.deepEqual(graph.samples, []);
    assert.throws(
      () =>
        timeInRounds([fake("x", false, 1)], 1, 20, () => {
          throw new Error("launch failed");
        }),
      /launch failed/,
    );
  });

  test("enter and leave bracket every round's runs, leave also after a failure; afterEach follows each", () => {
    const log: string[] = [];
    const m: Fake = {
      ...fake("m", true, 1),
      enter: () => log.push("enter"),
      leave: () => log.push("leave"),
    };
    let n = 0;
    timeInRounds(
      [m],
      2,
      20,
      () => {
        log.push("time");
        if (++n === 2) throw new Error("boom");
        return [1];
      },
      () => log.push("after"),
    );
    assert.deepEqual(log, ["enter", "time", "leave", "after", "enter", "time", "leave", "after"]);
    assert.equal(m.error, "boom");
  });

  test("rounds must be a whole number from 1 to the run count", () => {
    for (const rounds of [0, 1.5, 21]) {
      assert.throws(
        () => timeInRounds([], rounds, 20, () => []),
        /rounds must be an integer in \[1, iters = 20\]/,
      );
    }
  });
});
