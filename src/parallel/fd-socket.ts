/**
 * Passing file descriptors between processes: Unix-domain SOCK_SEQPACKET sockets driven through libc
 * (koffi), with the descriptors in SCM_RIGHTS control messages.
 *
 * Node's `net` module cannot send or receive descriptors, and the alternative that needs no socket,
 * pidfd_open + pidfd_getfd, needs ptrace rights over the peer (PTRACE_MODE_ATTACH), which Yama's
 * default ptrace_scope=1 denies between sibling processes; SCM_RIGHTS needs nothing but the socket
 * (docs/decisions.md). SOCK_SEQPACKET keeps message boundaries, so one message is one JSON text with
 * its descriptors. Every socket is non-blocking: a wait polls with poll(2) and yields to the event loop
 * between tries, so a peer that never comes is a timeout, not a hung process, and errno is read on the
 * thread that made the call. Linux on x86-64 or arm64 only (the struct layouts and constants below);
 * `fdPassingProblem()` says why it is unavailable elsewhere.
 */
import fs from "node:fs";
import { setTimeout as sleep } from "node:timers/promises";
import { hostAddress, type KoffiLibrary, koffi } from "../cuda/ffi.js";

// Linux values (the same on x86-64 and arm64).
const AF_UNIX = 1;
const SOCK_SEQPACKET = 5;
const SOCK_NONBLOCK = 0o4000;
const SOCK_CLOEXEC = 0o2000000;
const SOL_SOCKET = 1;
const SCM_RIGHTS = 1;
const MSG_CTRUNC = 0x8;
const MSG_TRUNC = 0x20;
const MSG_NOSIGNAL = 0x4000;
const MSG_CMSG_CLOEXEC = 0x40000000;
const POLLIN = 0x1;
const POLLOUT = 0x4;
const EINTR = 4;
const EAGAIN = 11;
const ENOENT = 2;
const ECONNREFUSED = 111;

/** `struct sockaddr_un`: sa_family_t sun_family (u16) then char sun_path[108]. */
const SUN_PATH_OFFSET = 2;
const SUN_PATH_MAX = 108;
/**
 * `struct msghdr` on LP64 Linux: msg_name @0, msg_namelen @8, msg_iov @16, msg_iovlen @24,
 * msg_control @32, msg_controllen @40, msg_flags @48; 56 bytes. (musl declares iovlen and controllen
 * as int + padding: on little-endian a 64-bit store of a small value writes the same bytes.)
 */
const MSGHDR = { size: 56, iov: 16, iovlen: 24, control: 32, controllen: 40, flags: 48 } as const;
/** `struct iovec`: iov_base @0, iov_len @8. */
const IOVEC_SIZE = 16;
/** `struct cmsghdr`: cmsg_len (size_t) @0, cmsg_level @8, cmsg_type @12, data @16 (CMSG_ALIGN 8). */
const CMSG_HEADER = 16;

/** The largest descriptor count one message carries (the kernel's SCM_MAX_FD). */
export const MAX_FDS_PER_MESSAGE = 253;
/** The largest JSON text of one message, in bytes. */
export const MAX_MESSAGE_BYTES = 64 * 1024;

interface Libc {
  socket(domain: number, type: number, protocol: number): number;
  socketpair(domain: number, type: number, protocol: number, out: Int32Array): number;
  bind(fd: number, addr: Uint8Array, len: number): number;
  listen(fd: number, backlog: number): number;
  accept4(fd: number, addr: null, len: null, flags: number): number;
  connect(fd: number, addr: Uint8Array, len: number): number;
  sendmsg(fd: number, msg: Uint8Array, flags: number): number;
  recvmsg(fd: number, msg: Uint8Array, flags: number): number;
  poll(fds: Uint8Array, count: number, timeoutMs: number): number;
  close(fd: number): number;
  strerror(errnum: number): string;
}

let libc: Libc | undefined;
let libcProblem: string | undefined;

/** Why descriptors cannot be passed here (platform, koffi, libc), or undefined when they can. */
export function fdPassingProblem(): string | undefined {
  if (process.platform !== "linux" || (process.arch !== "x64" && process.arch !== "arm64"))
    return `passing file descriptors is implemented for Linux on x64 and arm64 only (this is ${process.platform} ${process.arch})`;
  if (libc) return undefined;
  if (libcProblem) return libcProblem;
  try {
    const k = koffi();
    let lib: KoffiLibrary | undefined;
    const errors: string[] = [];
    for (const name of ["libc.so.6", "libc.so"]) {
      try {
        lib = k.load(name);
        break;
      } catch (e) {
        errors.push(`${name}: ${(e as Error).message}`);
      }
    }
    if (!lib) throw new Error(`libc could not be loaded (${errors.join("; ")})`);
    const l = lib;
    libc = {
      socket: l.func("int socket(int domain, int type, int protocol)"),
      socketpair: l.func("int socketpair(int domain, int type, int protocol, void *out)"),
      bind: l.func("int bind(int fd, void *addr, uint32_t len)"),
      listen: l.func("int listen(int fd, int backlog)"),
      accept4: l.func("int accept4(int fd, void *addr, void *len, int flags)"),
      connect: l.func("int connect(int fd, void *addr, uint32_t len)"),
      sendmsg: l.func("long sendmsg(int fd, void *msg, int flags)"),
      recvmsg: l.func("long recvmsg(int fd, void *msg, int flags)"),
      poll: l.func("int poll(void *fds, unsigned long count, int timeout)"),
      close: l.func("int close(int fd)"),
      strerror: l.func("const char *strerror(int errnum)"),
    } as unknown as Libc;
    return undefined;
  } catch (e) {
    libcProblem = `passing file descriptors needs libc through koffi: ${(e as Error).message}`;
    return libcProblem;
  }
}

function requireLibc(): Libc {
  const problem = fdPassingProblem();
  if (problem) throw new FdPassingError(problem);
  return libc!;
}

/** A failed socket operation or a protocol violation while passing descriptors. */
export class FdPassingError extends Error {
  /** errno of the failed call, when one failed. */
  readonly errno?: number;
  constructor(message: string, errno?: number) {
    super(message);
    this.name = "FdPassingError";
    if (errno !== undefined) this.errno = errno;
  }
}

function lastErrno(): number {
  return koffi().errno();
}

function sysError(call: string, errno: number, detail: string): FdPassingError {
  return new FdPassingError(`${call} failed: ${libc!.strerror(errno)} (errno ${errno}) [${detail}]`, errno);
}

/** `sockaddr_un` for a filesystem path, and its length for bind/connect. */
function socketAddress(path: string): { addr: Uint8Array; len: number } {
  const bytes = Buffer.from(path, "utf8");
  if (bytes.length === 0 || bytes.length >= SUN_PATH_MAX || bytes.includes(0))
    throw new FdPassingError(
      `socket path ${JSON.stringify(path)} must be 1 to ${SUN_PATH_MAX - 1} bytes without NUL (a Unix socket's limit); choose a shorter directory`,
    );
  const addr = new Uint8Array(new ArrayBuffer(SUN_PATH_OFFSET + SUN_PATH_MAX));
  new DataView(addr.buffer).setUint16(0, AF_UNIX, true);
  addr.set(bytes, SUN_PATH_OFFSET);
  return { addr, len: SUN_PATH_OFFSET + bytes.length + 1 };
}

/**
 * Wait until `fd` is ready for `events` or `deadline` (Date.now() ms) passes. Polls without blocking
 * and sleeps between tries (1 ms, doubling to 20 ms) so the event loop keeps running.
 */
async function waitReady(fd: number, events: number, deadline: number, what: string): Promise<void> {
  const pfd = new Uint8Array(new ArrayBuffer(8)); // struct pollfd { int fd; short events; short revents; }
  const v = new DataView(pfd.buffer);
  v.setInt32(0, fd, true);
  v.setInt16(4, events, true);
  for (let delay = 1; ; delay = Math.min(20, delay * 2)) {
    v.setInt16(6, 0, true);
    const n = libc!.poll(pfd, 1, 0);
    if (n < 0) {
      const errno = lastErrno();
      if (errno !== EINTR) throw sysError("poll", errno, what);
    } else if (n > 0) {
      return; // ready, or an error / hang-up that the call itself will report
    }
    if (Date.now() >= deadline) throw new FdPassingError(`timed out ${what}`);
    await sleep(delay);
  }
}

/** What one message carried: its JSON value and the descriptors received with it (now ours to close). */
export interface FdMessage {
  message: unknown;
  fds: number[];
}

/** One end of a connected SOCK_SEQPACKET Unix socket that carries JSON messages with descriptors. */
export class FdChannel {
  private fd: number;
  /** Who is at the other end, for messages ("rank 3", "the group leader"). */
  peer: string;

  private constructor(fd: number, peer: string) {
    this.fd = fd;
    this.peer = peer;
  }

  /** Two connected channels in this process (socketpair): for tests, and for handing one to a child. */
  static pair(): [FdChannel, FdChannel] {
    const c = requireLibc();
    const sv = new Int32Array(2);
    if (c.socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) !== 0)
      throw sysError("socketpair", lastErrno(), "AF_UNIX SOCK_SEQPACKET");
    return [new FdChannel(sv[0]!, "socketpair end 1"), new FdChannel(sv[1]!, "socketpair end 0")];
  }

  /**
   * Connect to the listener at `path`, retrying while it does not exist yet or refuses (the listening
   * process may start later) until `timeoutMs` passes.
   */
  static async connect(path: string, options: { timeoutMs: number; peer?: string }): Promise<FdChannel> {
    const c = requireLibc();
    const { addr, len } = socketAddress(path);
    const deadline = Date.now() + options.timeoutMs;
    for (let delay = 1; ; delay = Math.min(50, delay * 2)) {
      const fd = c.socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd < 0) throw sysError("socket", lastErrno(), "AF_UNIX SOCK_SEQPACKET");
      if (c.connect(fd, addr, len) === 0) return new FdChannel(fd, options.peer ?? path);
      const errno = lastErrno();
      c.close(fd);
      const retry = errno === ENOENT || errno === ECONNREFUSED || errno === EAGAIN || errno === EINTR;
      if (!retry) throw sysError("connect", errno, path);
      if (Date.now() >= deadline)
        throw new FdPassingError(
          `timed out after ${options.timeoutMs} ms connecting to ${path} (${c.strerror(errno)}): is the listening process up?`,
          errno,
        );
      await sleep(delay);
    }
  }

  /** @internal wrap an accepted descriptor */
  static fromAccepted(fd: number, peer: string): FdChannel {
    return new FdChannel(fd, peer);
  }

  get closed(): boolean {
    return this.fd < 0;
  }

  private live(): number {
    if (this.fd < 0) throw new FdPassingError(`channel to ${this.peer} used after close()`);
    return this.fd;
  }

  /**
   * Send `message` (JSON) with duplicates of `fds` attached; the caller keeps its own `fds` open and
   * closes them when it likes. Waits while the socket's buffer is full, up to `timeoutMs`.
   */
  async send(
    message: unknown,
    fds: readonly number[] = [],
    options: { timeoutMs?: number } = {},
  ): Promise<void> {
    const fd = this.live();
    const c = libc!;
    if (fds.length > MAX_FDS_PER_MESSAGE)
      throw new FdPassingError(
        `${fds.length} descriptors in one message: the kernel passes at most ${MAX_FDS_PER_MESSAGE}`,
      );
    for (const d of fds)
      if (!Number.isInteger(d) || d < 0) throw new FdPassingError(`not a file descriptor: ${d}`);
    const text = Buffer.from(JSON.stringify(message), "utf8");
    if (text.length > MAX_MESSAGE_BYTES)
      throw new FdPassingError(`message of ${text.length} bytes exceeds ${MAX_MESSAGE_BYTES}`);
    // Every buffer a pointer inside msghdr points at is ArrayBuffer-backed: off the moving JS heap.
    const data = new Uint8Array(new ArrayBuffer(Math.max(1, text.length)));
    data.set(text);
    const iov = new Uint8Array(new ArrayBuffer(IOVEC_SIZE));
    const iv = new DataView(iov.buffer);
    iv.setBigUint64(0, hostAddress(data), true);
    iv.setBigUint64(8, BigInt(text.length), true);
    const controlBytes = fds.length > 0 ? CMSG_HEADER + Math.ceil((4 * fds.length) / 8) * 8 : 0;
    const control = new Uint8Array(new ArrayBuffer(Math.max(8, controlBytes)));
    if (fds.length > 0) {
      const cv = new DataView(control.buffer);
      cv.setBigUint64(0, BigInt(CMSG_HEADER + 4 * fds.length), true); // CMSG_LEN
      cv.setInt32(8, SOL_SOCKET, true);
      cv.setInt32(12, SCM_RIGHTS, true);
      for (const [i, d] of fds.entries()) cv.setInt32(CMSG_HEADER + 4 * i, d, true);
    }
    const msg = new Uint8Array(new ArrayBuffer(MSGHDR.size));
    const mv = new DataView(msg.buffer);
    mv.setBigUint64(MSGHDR.iov, hostAddress(iov), true);
    mv.setBigUint64(MSGHDR.iovlen, 1n, true);
    if (controlBytes > 0) {
      mv.setBigUint64(MSGHDR.control, hostAddress(control), true);
      mv.setBigUint64(MSGHDR.controllen, BigInt(controlBytes), true);
    }
    const deadline = Date.now() + (options.timeoutMs ?? 30_000);
    for (;;) {
      const n = c.sendmsg(fd, msg, MSG_NOSIGNAL);
      if (n >= 0) {
        if (n !== text.length)
          throw new FdPassingError(`sendmsg to ${this.peer} sent ${n} of ${text.length} bytes`);
        return;
      }
      const errno = lastErrno();
      if (errno !== EAGAIN && errno !== EINTR) throw sysError("sendmsg", errno, `to ${this.peer}`);
      await waitReady(fd, POLLOUT, deadline, `sending to ${this.peer}`);
    }
  }

  /**
   * Receive one message. Descriptors arrive close-on-exec and belong to the caller. A closed peer, a
   * truncated message or truncated descriptors are errors (any descriptors that did arrive are closed).
   */
  async receive(options: { timeoutMs?: number } = {}): Promise<FdMessage> {
    const fd = this.live();
    const c = libc!;
    const data = new Uint8Array(new ArrayBuffer(MAX_MESSAGE_BYTES + 1));
    const iov = new Uint8Array(new ArrayBuffer(IOVEC_SIZE));
    const iv = new DataView(iov.buffer);
    iv.setBigUint64(0, hostAddress(data), true);
    iv.setBigUint64(8, BigInt(data.length), true);
    const controlBytes = CMSG_HEADER + 4 * MAX_FDS_PER_MESSAGE + 4;
    const control = new Uint8Array(new ArrayBuffer(controlBytes));
    const msg = new Uint8Array(new ArrayBuffer(MSGHDR.size));
    const mv = new DataView(msg.buffer);
    const deadline = Date.now() + (options.timeoutMs ?? 30_000);
    for (;;) {
      mv.setBigUint64(MSGHDR.iov, hostAddress(iov), true);
      mv.setBigUint64(MSGHDR.iovlen, 1n, true);
      mv.setBigUint64(MSGHDR.control, hostAddress(control), true);
      mv.setBigUint64(MSGHDR.controllen, BigInt(controlBytes), true);
      mv.setInt32(MSGHDR.flags, 0, true);
      const n = c.recvmsg(fd, msg, MSG_CMSG_CLOEXEC);
      if (n < 0) {
        const errno = lastErrno();
        if (errno !== EAGAIN && errno !== EINTR) throw sysError("recvmsg", errno, `from ${this.peer}`);
        await waitReady(fd, POLLIN, deadline, `waiting for a message from ${this.peer}`);
        continue;
      }
      const fds = receivedFds(control, Number(mv.getBigUint64(MSGHDR.controllen, true)));
      const flags = mv.getInt32(MSGHDR.flags, true);
      const fail: (why: string) => never = (why) => {
        for (const d of fds) c.close(d);
        throw new FdPassingError(`message from ${this.peer}: ${why}`);
      };
      if (n === 0) fail("the peer closed the connection");
      if (flags & MSG_TRUNC) fail(`longer than ${MAX_MESSAGE_BYTES} bytes`);
      if (flags & MSG_CTRUNC)
        fail("descriptors were dropped (truncated control data, or the fd limit reached)");
      let message: unknown;
      try {
        message = JSON.parse(Buffer.from(data.buffer, 0, n).toString("utf8"));
      } catch (e) {
        fail(`not JSON: ${(e as Error).message}`);
      }
      return { message, fds };
    }
  }

  /** Close the socket (idempotent). */
  close(): void {
    if (this.fd < 0) return;
    libc!.close(this.fd);
    this.fd = -1;
  }
}

/** The descriptors in SCM_RIGHTS control messages of `length` bytes. */
function receivedFds(control: Uint8Array, length: number): number[] {
  const v = new DataView(control.buffer);
  const fds: number[] = [];
  for (let at = 0; at + CMSG_HEADER <= length; ) {
    const len = Number(v.getBigUint64(at, true));
    if (len < CMSG_HEADER) break;
    if (v.getInt32(at + 8, true) === SOL_SOCKET && v.getInt32(at + 12, true) === SCM_RIGHTS)
      for (let i = 0; at + CMSG_HEADER + 4 * (i + 1) <= at + len; i++)
        fds.push(v.getInt32(at + CMSG_HEADER + 4 * i, true));
    at += Math.ceil(len / 8) * 8;
  }
  return fds;
}

/** A listening SOCK_SEQPACKET socket at a filesystem path; removes the path on close. */
export class FdListener {
  private fd: number;
  readonly path: string;

  private constructor(fd: number, path: string) {
    this.fd = fd;
    this.path = path;
  }

  /**
   * Listen at `path`. A stale socket file there (a crashed earlier run) is removed; any other file is
   * an error, as is a path too long for a Unix socket.
   */
  static listen(path: string, backlog = 64): FdListener {
    const c = requireLibc();
    const { addr, len } = socketAddress(path);
    let stat: fs.Stats | undefined;
    try {
      stat = fs.lstatSync(path);
    } catch {
      // nothing there
    }
    if (stat) {
      if (!stat.isSocket()) throw new FdPassingError(`${path} exists and is not a socket`);
      fs.unlinkSync(path);
    }
    const fd = c.socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) throw sysError("socket", lastErrno(), "AF_UNIX SOCK_SEQPACKET");
    if (c.bind(fd, addr, len) !== 0) {
      const errno = lastErrno();
      c.close(fd);
      throw sysError("bind", errno, path);
    }
    if (c.listen(fd, backlog) !== 0) {
      const errno = lastErrno();
      c.close(fd);
      fs.rmSync(path, { force: true });
      throw sysError("listen", errno, path);
    }
    return new FdListener(fd, path);
  }

  /** The next connection, waiting up to `timeoutMs`. */
  async accept(options: { timeoutMs: number; peer?: string }): Promise<FdChannel> {
    if (this.fd < 0) throw new FdPassingError(`listener at ${this.path} used after close()`);
    const deadline = Date.now() + options.timeoutMs;
    for (;;) {
      const fd = libc!.accept4(this.fd, null, null, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd >= 0) return FdChannel.fromAccepted(fd, options.peer ?? `a peer of ${this.path}`);
      const errno = lastErrno();
      if (errno !== EAGAIN && errno !== EINTR) throw sysError("accept4", errno, this.path);
      await waitReady(this.fd, POLLIN, deadline, `waiting for connections at ${this.path}`);
    }
  }

  /** Stop listening and remove the socket file (idempotent). */
  close(): void {
    if (this.fd < 0) return;
    libc!.close(this.fd);
    this.fd = -1;
    fs.rmSync(this.path, { force: true });
  }
}
