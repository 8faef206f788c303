/**
 * Passing descriptors over SOCK_SEQPACKET sockets (src/parallel/fd-socket.ts), on the CPU: a file's
 * descriptor sent through a socketpair and to another process arrives as the same open file (same
 * inode, writes through one seen through the other); message boundaries, timeouts and errors.
 * Skipped where fd passing is unavailable (not Linux x64/arm64).
 */
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, describe, test } from "node:test";
import { fileURLToPath } from "node:url";
import { FdChannel, FdListener, FdPassingError, fdPassingProblem } from "../../src/parallel/fd-socket.js";

const skip = fdPassingProblem() ?? false;
const dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-fd-"));
after(() => fs.rmSync(dir, { recursive: true, force: true }));

function sameFile(a: number, b: number): boolean {
  const sa = fs.fstatSync(a);
  const sb = fs.fstatSync(b);
  return sa.ino === sb.ino && sa.dev === sb.dev;
}

describe("descriptor passing", { skip }, () => {
  test("a socketpair carries JSON with descriptors of the same open files, message by message", async () => {
    const [a, b] = FdChannel.pair();
    const file = path.join(dir, "pair.bin");
    fs.writeFileSync(file, "hello");
    const fd = fs.openSync(file, "r+");
    const other = fs.openSync(path.join(dir, "pair2.bin"), "w+");
    try {
      await a.send({ kind: "first", n: 1 }, [fd, other]);
      await a.send({ kind: "second" }); // no descriptors, and a separate message
      const got = await b.receive({ timeoutMs: 1000 });
      assert.deepEqual(got.message, { kind: "first", n: 1 });
      assert.equal(got.fds.length, 2);
      assert.ok(!got.fds.includes(fd), "a new descriptor number, not ours");
      assert.ok(sameFile(got.fds[0]!, fd), "the first descriptor is the first file");
      assert.ok(sameFile(got.fds[1]!, other), "the second descriptor is the second file");
      assert.ok(!sameFile(got.fds[0]!, other));
      // the same open file description: a write through the received descriptor shows through ours
      fs.writeSync(got.fds[0]!, "J", 0);
      const back = Buffer.alloc(5);
      fs.readSync(fd, back, 0, 5, 0);
      assert.equal(back.toString(), "Jello");
      for (const d of got.fds) fs.closeSync(d);
      const second = await b.receive({ timeoutMs: 1000 });
      assert.deepEqual(second, { message: { kind: "second" }, fds: [] });
    } finally {
      fs.closeSync(fd);
      fs.closeSync(other);
      a.close();
      b.close();
    }
  });

  test("waiting ends in a timeout, a closed peer and bad arguments are errors", async () => {
    const [a, b] = FdChannel.pair();
    await assert.rejects(b.receive({ timeoutMs: 30 }), /timed out waiting for a message/);
    a.close();
    await assert.rejects(b.receive({ timeoutMs: 1000 }), /the peer closed the connection/);
    b.close();
    b.close(); // idempotent
    await assert.rejects(b.receive(), /used after close/);
    const [c, d] = FdChannel.pair();
    await assert.rejects(c.send({}, [-1]), /not a file descriptor: -1/);
    await assert.rejects(c.send({}, new Array(254).fill(0)), /at most 253/);
    await assert.rejects(c.send({ s: "x".repeat(70_000) }), /exceeds 65536/);
    c.close();
    d.close();
    await assert.rejects(
      FdChannel.connect(path.join(dir, "nobody.sock"), { timeoutMs: 40 }),
      (e: unknown) => e instanceof FdPassingError && /timed out after 40 ms connecting/.test(e.message),
    );
    assert.throws(() => FdListener.listen(path.join(dir, "x".repeat(120))), /must be 1 to 107 bytes/);
    const notSocket = path.join(dir, "plain-file");
    fs.writeFileSync(notSocket, "");
    assert.throws(() => FdListener.listen(notSocket), /exists and is not a socket/);
  });

  test("another process receives a descriptor through a listener and writes through it", async () => {
    const socketPath = path.join(dir, "group.sock");
    const listener = FdListener.listen(socketPath);
    const file = path.join(dir, "shared.bin");
    fs.writeFileSync(file, "........");
    const fd = fs.openSync(file, "r+");
    const here = fileURLToPath(import.meta.url);
    const module = path.join(
      path.dirname(here),
      "..",
      "..",
      "src",
      "parallel",
      `fd-socket${path.extname(here)}`,
    );
    // The child connects, receives one descriptor, writes its pid through it and answers with its fstat.
    const script = `
      import fs from "node:fs";
      import { FdChannel } from ${JSON.stringify(module)};
      const ch = await FdChannel.connect(${JSON.stringify(socketPath)}, { timeoutMs: 10000 });
      const { message, fds } = await ch.receive({ timeoutMs: 10000 });
      fs.writeSync(fds[0], message.text, 0);
      const st = fs.fstatSync(fds[0]);
      await ch.send({ ino: String(st.ino), dev: String(st.dev), fds: fds.length });
      ch.close();
    `;
    const { NODE_TEST_CONTEXT: _, ...env } = process.env;
    const loader = path.extname(here) === ".ts" ? ["--import", "tsx"] : [];
    const child = spawn(process.execPath, [...loader, "--input-type=module", "-e", script], {
      env,
      stdio: ["ignore", "inherit", "pipe"],
    });
    let stderr = "";
    child.stderr.on("data", (chunk) => {
      stderr += chunk;
    });
    const exited = new Promise<number | null>((resolve) => child.on("exit", resolve));
    try {
      const ch = await listener.accept({ timeoutMs: 20_000 });
      await ch.send({ text: "from-kid" }, [fd]);
      const reply = (await ch.receive({ timeoutMs: 20_000 })).message as Record<string, unknown>;
      const st = fs.fstatSync(fd);
      assert.deepEqual(reply, { ino: String(st.ino), dev: String(st.dev), fds: 1 });
      ch.close();
      assert.equal(await exited, 0, stderr);
      assert.equal(fs.readFileSync(file, "utf8"), "from-kid");
    } finally {
      child.kill();
      fs.closeSync(fd);
      listener.close();
    }
    assert.equal(fs.existsSync(socketPath), false, "the listener removes its socket file");
  });
});
