/**
 * Symmetric memory for expert parallelism: R ranks, each with a buffer of the same size, every buffer
 * mapped readable and writable into the address space of every participating device, so a kernel
 * addresses "rank r's buffer" as base + r · stride (or through the table of R addresses).
 *
 * Built on CUDA's virtual memory management: each rank's buffer is its own physical allocation
 * (cuMemCreate on the rank's device), and one virtual range of R · stride bytes (cuMemAddressReserve)
 * holds them side by side (cuMemMap), opened to each device with cuMemSetAccess. That access, not
 * cuCtxEnablePeerAccess, is what lets a device reach a peer's allocation; the devices must still be
 * able to reach each other (cuDeviceCanAccessPeer).
 *
 * Three ways to build one:
 * - `SymmetricHeap.create(devices, bytes)`: one process, rank r on `devices[r]`. With R devices that is
 *   rank r on GPU r; with one device repeated R times it is R "virtual ranks" on one GPU (how the
 *   protocol is tested on a single device); any mix works.
 * - `SymmetricHeap.join({ device, rank, ranks, bytes, socketPath })`: one rank per process. Each process
 *   creates its own buffer exportable as a POSIX file descriptor, and the descriptors travel over a Unix
 *   socket (SCM_RIGHTS, ./fd-socket.ts): rank 0 listens at `socketPath`, collects every rank's
 *   descriptor and hands each rank the others'. Every process then maps all R buffers in its own range;
 *   the ranges' bases differ between processes, the layout (slot r at base + r · stride) does not.
 *
 * Teardown (dispose, or a failure part-way through construction) synchronizes the local devices, then
 * unmaps every mapped slot, releases every handle (created or imported), frees the reservation, and
 * closes descriptors and sockets; it goes on past a failing step and reports every failure. A peer
 * process's teardown does not pull memory from under the others: each importer holds its own
 * reference to the allocation, which lives until the last one is released.
 */
import { closeSync } from "node:fs";
import { checkOptionFields } from "../config/config.js";
import { check, cu, cudaAvailability, outI32, outU64, requireCuda } from "../cuda/driver-api.js";
import {
  DeviceAttribute,
  MemAccessFlags,
  MemAllocGranularity,
  MemHandleType,
  memAccessDescs,
  memAllocationProp,
} from "../cuda/driver-constants.js";
import { type Device, DeviceTensor, type Stream } from "../cuda/index.js";
import { FdChannel, FdListener, fdPassingProblem, MAX_FDS_PER_MESSAGE } from "./fd-socket.js";

/** A symmetric heap that cannot be built here: bad arguments, missing support, unreachable peers. */
export class SymmetricHeapError extends Error {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = "SymmetricHeapError";
  }
}

/** Options of {@link SymmetricHeap.join}: this process's rank in a group of processes. */
export interface JoinOptions {
  /** This process's GPU (its rank's buffer lives there, and only this device is granted access here). */
  device: Device;
  /** This process's rank, 0 … ranks − 1; rank 0 listens at `socketPath`. */
  rank: number;
  ranks: number;
  /** Bytes per rank (every rank must ask for the same). */
  bytes: number;
  /** A filesystem path for the group's Unix socket (under 108 bytes), the same in every process. */
  socketPath: string;
  /** How long to wait for the other processes at each step (default 60 s). */
  timeoutMs?: number;
}

/** One rank's slot: where its buffer is mapped here and the handle of the allocation mapped there. */
interface Slot {
  /** The rank's device when this process drives it; undefined for a rank of another process. */
  device: Device | undefined;
  handle: bigint | undefined;
  mapped: boolean;
  /** Whether this process created the allocation (and zeroes it). */
  owned: boolean;
}

/** What a process says about itself when it joins a group. */
interface Hello {
  type: "hello";
  rank: number;
  ranks: number;
  bytes: number;
  stride: number;
  bus: string;
  pid: number;
}
interface Welcome {
  type: "welcome";
  stride: number;
  members: { rank: number; bus: string; pid: number }[];
  /** The rank of each descriptor attached, in order. */
  fdRanks: number[];
}
type GroupMessage =
  | Hello
  | Welcome
  | { type: "barrier"; n: number }
  | { type: "release"; n: number }
  | { type: "error"; rank: number; message: string };

function checkCount(what: string, value: number, min: number): void {
  if (!Number.isSafeInteger(value) || value < min)
    throw new SymmetricHeapError(`${what} must be an integer ≥ ${min} (got ${value})`);
}

function gcd(a: number, b: number): number {
  return b === 0 ? a : gcd(b, a % b);
}

/** "dddd:bb:dd", the device's PCI address from its attributes (the same GPU in every process). */
function pciAddress(handle: number): string {
  const attr = (a: number) => {
    check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(outI32, a, handle), `attribute ${a}`);
    return outI32[0]!;
  };
  const hex = (v: number, n: number) => v.toString(16).padStart(n, "0");
  return `${hex(attr(DeviceAttribute.PCI_DOMAIN_ID), 4)}:${hex(attr(DeviceAttribute.PCI_BUS_ID), 2)}:${hex(attr(DeviceAttribute.PCI_DEVICE_ID), 2)}`;
}

/** The CUdevice with PCI address `bus` among this process's visible devices, or undefined. */
function deviceAtPci(bus: string): number | undefined {
  const a = cudaAvailability();
  if (!a.ok) return undefined;
  for (let i = 0; i < a.deviceCount; i++) {
    if (cu.cuDeviceGet(outI32, i) !== 0) continue;
    const handle = outI32[0]!;
    if (pciAddress(handle) === bus) return handle;
  }
  return undefined;
}

function label(device: Device): string {
  return `device ${device.ordinal} (${device.name})`;
}

/** The ranks on each device, for messages: "ranks 0, 2". */
function ranksOn(devices: readonly Device[], device: Device): string {
  const list = devices.flatMap((d, r) => (d === device ? [r] : []));
  return `${list.length === 1 ? "rank" : "ranks"} ${list.join(", ")}`;
}

/**
 * Check that every device supports VMM (and POSIX-fd export when `exportable`) and that every pair of
 * distinct devices can reach each other; return the allocation granularity that suits all of them.
 */
function checkDevices(devices: readonly Device[], exportable: boolean): number {
  const distinct = [...new Set(devices)];
  for (const d of distinct) {
    if (d.attribute(DeviceAttribute.VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) === 0)
      throw new SymmetricHeapError(
        `${label(d)}, holding ${ranksOn(devices, d)}, does not support CUDA virtual memory management ` +
          "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0): a symmetric heap needs cuMemCreate and cuMemMap",
      );
    if (exportable && d.attribute(DeviceAttribute.HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) === 0)
      throw new SymmetricHeapError(
        `${label(d)} cannot export allocations as POSIX file descriptors ` +
          "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0): its buffer cannot be shared with other processes",
      );
  }
  for (const a of distinct)
    for (const b of distinct)
      if (a !== b && !a.canAccessPeer(b))
        throw new SymmetricHeapError(
          `${label(a)} cannot access ${label(b)}'s memory (cuDeviceCanAccessPeer is 0): ` +
            `${ranksOn(devices, a)} could not reach the buffers of ${ranksOn(devices, b)}`,
        );
  let granularity = 1;
  for (const d of distinct) {
    const prop = memAllocationProp(
      d.ordinal,
      exportable ? MemHandleType.POSIX_FILE_DESCRIPTOR : MemHandleType.NONE,
    );
    check(
      "cuMemGetAllocationGranularity",
      cu.cuMemGetAllocationGranularity(outU64, prop, MemAllocGranularity.RECOMMENDED),
      label(d),
    );
    const g = Number(outU64[0]);
    granularity = (granularity / gcd(granularity, g)) * g;
  }
  return granularity;
}

/** R equal buffers, one per rank, each mapped for every participating device. See the module comment. */
export class SymmetricHeap {
  /** Number of ranks. */
  readonly ranks: number;
  /** Bytes asked for per rank. */
  readonly bytes: number;
  /** Bytes per rank as mapped: `bytes` rounded up to the allocation granularity; slot r starts at base + r · stride. */
  readonly stride: number;
  /** The granularity `stride` is a multiple of (the largest the devices recommend). */
  readonly granularity: number;
  /** This process's rank in a group ({@link join}); undefined when every rank is in this process. */
  readonly rank: number | undefined;
  private reservation = 0n;
  private readonly slots: Slot[];
  private readonly devices: Device[];
  private readonly channels: FdChannel[] = [];
  private listener: FdListener | undefined;
  private readonly openFds = new Set<number>();
  private barriers = 0;
  private disposed = false;

  private constructor(
    ranks: number,
    bytes: number,
    granularity: number,
    localDevices: Device[],
    rank?: number,
  ) {
    this.ranks = ranks;
    this.bytes = bytes;
    this.granularity = granularity;
    this.stride = Math.ceil(bytes / granularity) * granularity;
    this.rank = rank;
    this.devices = localDevices;
    this.slots = Array.from({ length: ranks }, () => ({
      device: undefined,
      handle: undefined,
      mapped: false,
      owned: false,
    }));
    if (!Number.isSafeInteger(this.stride * ranks))
      throw new SymmetricHeapError(`${ranks} ranks × ${this.stride} bytes is too large`);
  }

  /**
   * Rank r's buffer on `devices[r]`, all in this process: R distinct devices for one rank per GPU, one
   * device repeated for virtual ranks. Every buffer is mapped for every device listed.
   */
  static create(devices: readonly Device[], bytes: number): SymmetricHeap {
    checkCount("the number of ranks (devices.length)", devices.length, 1);
    checkCount("bytes per rank", bytes, 1);
    requireCuda();
    const granularity = checkDevices(devices, false);
    const distinct = [...new Set(devices)];
    const heap = new SymmetricHeap(devices.length, bytes, granularity, distinct);
    heap.build(() => {
      heap.reserve();
      devices.forEach((d, r) => {
        heap.createSlot(r, d, false);
        heap.mapSlot(r, `rank ${r} on ${label(d)}`);
      });
    });
    return heap;
  }

  /** `ranks` virtual ranks on one device: each its own allocation, all mapped side by side. */
  static virtualRanks(device: Device, ranks: number, bytes: number): SymmetricHeap {
    checkCount("the number of ranks", ranks, 1);
    return SymmetricHeap.create(new Array<Device>(ranks).fill(device), bytes);
  }

  /**
   * Join a group of `ranks` processes, one rank each, meeting at `socketPath` (rank 0 listens there).
   * Resolves once every process has mapped every buffer. Fails, in every process that is still
   * talking, when the processes disagree on ranks or sizes, a rank is taken twice, a peer's device is
   * unreachable, or a process does not arrive within `timeoutMs`.
   */
  static async join(options: JoinOptions): Promise<SymmetricHeap> {
    if (options === undefined) throw new SymmetricHeapError("SymmetricHeap.join needs its options");
    checkOptionFields(
      "SymmetricHeap.join options",
      options,
      ["device", "rank", "ranks", "bytes", "socketPath", "timeoutMs"],
      (m) => new SymmetricHeapError(m),
    );
    const { device, rank, ranks, bytes, socketPath } = options;
    const timeoutMs = options.timeoutMs ?? 60_000;
    checkCount("the number of ranks", ranks, 1);
    checkCount("bytes per rank", bytes, 1);
    if (!Number.isSafeInteger(rank) || rank < 0 || rank >= ranks)
      throw new SymmetricHeapError(`rank must be an integer in [0, ${ranks}) (got ${rank})`);
    if (ranks > MAX_FDS_PER_MESSAGE + 1)
      throw new SymmetricHeapError(`at most ${MAX_FDS_PER_MESSAGE + 1} ranks per group (got ${ranks})`);
    const problem = fdPassingProblem();
    if (problem) throw new SymmetricHeapError(`cannot share buffers between processes: ${problem}`);
    requireCuda();
    const granularity = checkDevices([device], true);
    const heap = new SymmetricHeap(ranks, bytes, granularity, [device], rank);
    try {
      heap.createSlot(rank, device, true);
      check(
        "cuMemExportToShareableHandle",
        cu.cuMemExportToShareableHandle(
          outI32,
          heap.slots[rank]!.handle!,
          MemHandleType.POSIX_FILE_DESCRIPTOR,
          0n,
        ),
        `rank ${rank} on ${label(device)}`,
      );
      const ownFd = outI32[0]!;
      heap.openFds.add(ownFd);
      const hello: Hello = {
        type: "hello",
        rank,
        ranks,
        bytes,
        stride: heap.stride,
        bus: pciAddress(device.handle),
        pid: process.pid,
      };
      const { members, fds } =
        rank === 0
          ? await heap.lead(hello, ownFd, socketPath, timeoutMs)
          : await heap.follow(hello, ownFd, socketPath, timeoutMs);
      heap.closeFd(ownFd); // the peers hold their own references now
      heap.reserve();
      heap.mapSlot(rank, `rank ${rank} on ${label(device)}`);
      for (const m of members) {
        if (m.rank === rank) continue;
        const peerDevice = deviceAtPci(m.bus);
        const where = `rank ${m.rank} (process ${m.pid}, GPU at PCI ${m.bus}${peerDevice === undefined ? ", not visible in this process" : ""})`;
        if (peerDevice !== undefined && peerDevice !== device.handle) {
          check("cuDeviceCanAccessPeer", cu.cuDeviceCanAccessPeer(outI32, device.handle, peerDevice));
          if (outI32[0] === 0)
            throw new SymmetricHeapError(
              `${label(device)} (rank ${rank}) cannot access the memory of ${where} (cuDeviceCanAccessPeer is 0)`,
            );
        }
        const fd = fds.get(m.rank)!;
        check(
          "cuMemImportFromShareableHandle",
          cu.cuMemImportFromShareableHandle(outU64, BigInt(fd), MemHandleType.POSIX_FILE_DESCRIPTOR),
          `${where}, into rank ${rank}`,
        );
        heap.slots[m.rank]!.handle = outU64[0]!;
        heap.closeFd(fd);
        heap.mapSlot(m.rank, where);
      }
      await heap.barrier(timeoutMs);
      return heap;
    } catch (e) {
      // Tell the others (best effort) so they fail now rather than at their timeout.
      const message = (e as Error).message;
      await Promise.allSettled(
        heap.channels.map((ch) => ch.send({ type: "error", rank, message }, [], { timeoutMs: 1000 })),
      );
      return heap.abandon(e);
    }
  }

  /** Rank 0: accept the others, check they agree, and hand every rank the descriptors of the others. */
  private async lead(
    hello: Hello,
    ownFd: number,
    socketPath: string,
    timeoutMs: number,
  ): Promise<{ members: Welcome["members"]; fds: Map<number, number> }> {
    this.listener = FdListener.listen(socketPath);
    const byRank = new Map<number, { hello: Hello; fd: number; channel: FdChannel }>();
    const fail = async (message: string): Promise<never> => {
      await Promise.allSettled(
        this.channels.map((ch) => ch.send({ type: "error", rank: 0, message }, [], { timeoutMs: 1000 })),
      );
      throw new SymmetricHeapError(message);
    };
    const deadline = Date.now() + timeoutMs;
    while (byRank.size < hello.ranks - 1) {
      const left = Math.max(1, deadline - Date.now());
      const channel = await this.listener.accept({ timeoutMs: left }).catch((e: Error) => {
        const missing = Array.from({ length: hello.ranks }, (_, r) => r).filter(
          (r) => r > 0 && !byRank.has(r),
        );
        throw new SymmetricHeapError(
          `rank 0 at ${socketPath}: ranks ${missing.join(", ")} did not join: ${e.message}`,
        );
      });
      this.channels.push(channel);
      const { message, fds } = await channel.receive({ timeoutMs: left });
      for (const fd of fds) this.openFds.add(fd);
      const m = message as Hello;
      if (m?.type !== "hello" || fds.length !== 1)
        await fail(
          `rank 0: a peer sent ${JSON.stringify(message)} with ${fds.length} descriptors instead of its hello and one descriptor`,
        );
      channel.peer = `rank ${m.rank} (process ${m.pid})`;
      if (m.ranks !== hello.ranks || m.bytes !== hello.bytes || m.stride !== hello.stride)
        await fail(
          `rank ${m.rank} (process ${m.pid}) asked for ${m.ranks} ranks × ${m.bytes} bytes (stride ${m.stride}); ` +
            `rank 0 for ${hello.ranks} × ${hello.bytes} (stride ${hello.stride})`,
        );
      if (!Number.isInteger(m.rank) || m.rank <= 0 || m.rank >= hello.ranks || byRank.has(m.rank))
        await fail(
          `process ${m.pid} claims rank ${m.rank}, which is ${byRank.has(m.rank) ? `already taken by process ${byRank.get(m.rank)!.hello.pid}` : "out of range"}`,
        );
      byRank.set(m.rank, { hello: m, fd: fds[0]!, channel });
    }
    this.listener.close();
    this.listener = undefined;
    const members = [hello, ...[...byRank.values()].map((v) => v.hello)]
      .map(({ rank, bus, pid }) => ({ rank, bus, pid }))
      .sort((a, b) => a.rank - b.rank);
    const fdOf = (r: number) => (r === 0 ? ownFd : byRank.get(r)!.fd);
    // Keep the channels in rank order (rank r at index r − 1), as the barrier reads them.
    this.channels.splice(
      0,
      this.channels.length,
      ...[...byRank.keys()].sort((a, b) => a - b).map((r) => byRank.get(r)!.channel),
    );
    for (const [r, { channel }] of byRank) {
      const fdRanks = members.map((m) => m.rank).filter((q) => q !== r);
      const welcome: Welcome = { type: "welcome", stride: this.stride, members, fdRanks };
      await channel.send(welcome, fdRanks.map(fdOf), { timeoutMs });
    }
    const fds = new Map<number, number>();
    for (const [r, { fd }] of byRank) fds.set(r, fd);
    return { members, fds };
  }

  /** Ranks 1 … R − 1: send our hello and descriptor to rank 0, receive the others'. */
  private async follow(
    hello: Hello,
    ownFd: number,
    socketPath: string,
    timeoutMs: number,
  ): Promise<{ members: Welcome["members"]; fds: Map<number, number> }> {
    const channel = await FdChannel.connect(socketPath, { timeoutMs, peer: "rank 0" });
    this.channels.push(channel);
    await channel.send(hello, [ownFd], { timeoutMs });
    const { message, fds } = await channel.receive({ timeoutMs });
    for (const fd of fds) this.openFds.add(fd);
    const m = message as GroupMessage;
    if (m?.type === "error") throw new SymmetricHeapError(`rank ${m.rank} stopped the group: ${m.message}`);
    if (m?.type !== "welcome" || m.fdRanks.length !== fds.length || fds.length !== hello.ranks - 1)
      throw new SymmetricHeapError(
        `rank ${hello.rank}: rank 0 sent ${JSON.stringify(message)} with ${fds.length} descriptors instead of a welcome with ${hello.ranks - 1}`,
      );
    const byRank = new Map(m.fdRanks.map((r, i) => [r, fds[i]!]));
    return { members: m.members, fds: byRank };
  }

  /**
   * Wait until every process of the group reaches its own barrier (a host-side barrier over the group's
   * sockets). A process that failed instead makes every waiting one throw its error. Resolves at once
   * when every rank is in this process.
   */
  async barrier(timeoutMs = 60_000): Promise<void> {
    this.live();
    if (this.rank === undefined || this.ranks === 1) return;
    const n = ++this.barriers;
    const expectRelease = (m: GroupMessage, from: string) => {
      if (m?.type === "error") throw new SymmetricHeapError(`rank ${m.rank} failed: ${m.message}`);
      if (m?.type !== "release" || m.n !== n)
        throw new SymmetricHeapError(`barrier ${n}: ${from} sent ${JSON.stringify(m)}`);
    };
    if (this.rank !== 0) {
      const ch = this.channels[0]!;
      await ch.send({ type: "barrier", n }, [], { timeoutMs });
      const { message, fds } = await ch.receive({ timeoutMs });
      for (const fd of fds) this.closeFdQuietly(fd);
      expectRelease(message as GroupMessage, "rank 0");
      return;
    }
    let failure: { rank: number; message: string } | undefined;
    for (const ch of this.channels) {
      const { message, fds } = await ch.receive({ timeoutMs }).catch((e: Error) => {
        throw new SymmetricHeapError(`barrier ${n}: ${ch.peer}: ${e.message}`);
      });
      for (const fd of fds) this.closeFdQuietly(fd);
      const m = message as GroupMessage;
      if (m?.type === "error") {
        failure = { rank: m.rank, message: m.message };
        break;
      }
      if (m?.type !== "barrier" || m.n !== n)
        failure = { rank: 0, message: `barrier ${n}: ${ch.peer} sent ${JSON.stringify(m)}` };
      if (failure) break;
    }
    const reply: GroupMessage = failure ? { type: "error", ...failure } : { type: "release", n };
    await Promise.allSettled(this.channels.map((ch) => ch.send(reply, [], { timeoutMs })));
    if (failure) throw new SymmetricHeapError(`rank ${failure.rank} failed: ${failure.message}`);
  }

  // -------------------------------------------------------------------------------------------------
  // Construction steps (each records what it made, for teardown)

  private build(steps: () => void): void {
    try {
      steps();
    } catch (e) {
      this.abandon(e);
    }
  }

  private reserve(): void {
    const total = this.stride * this.ranks;
    check(
      "cuMemAddressReserve",
      cu.cuMemAddressReserve(outU64, total, this.granularity, 0n, 0n),
      `${this.ranks} ranks × ${this.stride} bytes`,
    );
    this.reservation = outU64[0]!;
  }

  private createSlot(r: number, device: Device, exportable: boolean): void {
    device.makeCurrent();
    const prop = memAllocationProp(
      device.ordinal,
      exportable ? MemHandleType.POSIX_FILE_DESCRIPTOR : MemHandleType.NONE,
    );
    check(
      "cuMemCreate",
      cu.cuMemCreate(outU64, this.stride, prop, 0n),
      `rank ${r} on ${label(device)}, ${this.stride} bytes`,
    );
    const slot = this.slots[r]!;
    slot.handle = outU64[0]!;
    slot.device = device;
    slot.owned = true;
  }

  /** Map slot r's handle at its place and open it to every device of this process. */
  private mapSlot(r: number, who: string): void {
    const slot = this.slots[r]!;
    const at = this.address(r);
    check("cuMemMap", cu.cuMemMap(at, this.stride, 0, slot.handle!, 0n), who);
    slot.mapped = true;
    const ordinals = this.devices.map((d) => d.ordinal);
    check(
      "cuMemSetAccess",
      cu.cuMemSetAccess(
        at,
        this.stride,
        memAccessDescs(ordinals, MemAccessFlags.PROT_READWRITE),
        ordinals.length,
      ),
      `${who}, read-write for device${ordinals.length > 1 ? "s" : ""} ${ordinals.join(", ")}`,
    );
  }

  private closeFd(fd: number): void {
    this.openFds.delete(fd);
    closeSync(fd);
  }

  private closeFdQuietly(fd: number): void {
    try {
      this.closeFd(fd);
    } catch {
      // already closed
    }
  }

  /** Tear down after a failed construction and throw `cause` (with any cleanup failures attached). */
  private abandon(cause: unknown): never {
    const errors = this.teardown(false);
    if (errors.length === 0) throw cause;
    throw new AggregateError(
      [cause, ...errors],
      `${(cause as Error).message}; cleaning up then failed too: ${errors.map((e) => (e as Error).message).join("; ")}`,
    );
  }

  /**
   * Undo whatever was built, in order: wait for the local devices (`synchronize`), unmap every slot,
   * release every handle, free the reservation, close descriptors and sockets. Every step is tried;
   * the failures are returned.
   */
  private teardown(synchronize: boolean): unknown[] {
    const errors: unknown[] = [];
    const attempt = (f: () => void) => {
      try {
        f();
      } catch (e) {
        errors.push(e);
      }
    };
    if (synchronize) for (const d of this.devices) attempt(() => d.synchronize());
    this.slots.forEach((slot, r) => {
      if (!slot.mapped) return;
      attempt(() => check("cuMemUnmap", cu.cuMemUnmap(this.address(r), this.stride), `rank ${r}`));
      slot.mapped = false;
    });
    this.slots.forEach((slot, r) => {
      if (slot.handle === undefined) return;
      attempt(() => check("cuMemRelease", cu.cuMemRelease(slot.handle!), `rank ${r}`));
      slot.handle = undefined;
    });
    if (this.reservation !== 0n) {
      attempt(() =>
        check("cuMemAddressFree", cu.cuMemAddressFree(this.reservation, this.stride * this.ranks)),
      );
      this.reservation = 0n;
    }
    for (const fd of [...this.openFds]) attempt(() => this.closeFd(fd));
    for (const ch of this.channels) attempt(() => ch.close());
    if (this.listener) attempt(() => this.listener!.close());
    this.disposed = true;
    return errors;
  }

  // -------------------------------------------------------------------------------------------------
  // Use

  private live(): void {
    if (this.disposed) throw new SymmetricHeapError("symmetric heap used after dispose()");
  }

  /** Start of the reservation: rank r's buffer is at base + r · stride. */
  get base(): bigint {
    this.live();
    return this.reservation;
  }

  /**
   * Address of rank r's buffer as seen from this process's devices (one address space per process:
   * the same for every device here; in another process of a group the base differs).
   */
  address(r: number): bigint {
    this.live();
    if (!Number.isInteger(r) || r < 0 || r >= this.ranks)
      throw new RangeError(`rank ${r} is not in [0, ${this.ranks})`);
    return this.reservation + BigInt(r) * BigInt(this.stride);
  }

  /** The R buffer addresses, rank order: the table a kernel gets. */
  addressTable(): BigUint64Array {
    const table = new BigUint64Array(this.ranks);
    for (let r = 0; r < this.ranks; r++) table[r] = this.address(r);
    return table;
  }

  /** {@link addressTable} copied to `device` (int64[R]); the caller disposes it. */
  addressTableOn(device: Device): DeviceTensor<"int64"> {
    const table = this.addressTable();
    return DeviceTensor.fromHost(device, "int64", [this.ranks], new BigInt64Array(table.buffer));
  }

  /** The device of rank r when this process holds it, else undefined (a rank of another process). */
  deviceOf(r: number): Device | undefined {
    this.address(r);
    return this.slots[r]!.owned ? this.slots[r]!.device : undefined;
  }

  /** Ranks whose buffers this process allocated (all of them, or this process's own rank in a group). */
  get localRanks(): number[] {
    return this.slots.flatMap((s, r) => (s.owned ? [r] : []));
  }

  /**
   * Zero the buffers this process allocated (each on its own device), synchronously or queued on
   * `stream` when every local rank is on that stream's device. Another process zeroes its own.
   */
  zero(stream?: Stream | null): void {
    this.live();
    for (const r of this.localRanks) {
      const device = this.slots[r]!.device!;
      if (stream && stream.device !== device)
        throw new SymmetricHeapError(
          `zero: rank ${r} is on ${label(device)}, the stream on ${label(stream.device)}`,
        );
      device.memsetD8(this.address(r), 0, this.stride, stream);
    }
  }

  /** Unmap and release everything (after waiting for the local devices); idempotent. */
  dispose(): void {
    if (this.disposed) return;
    const errors = this.teardown(true);
    if (errors.length === 1) throw errors[0];
    if (errors.length > 1)
      throw new AggregateError(
        errors,
        `disposing the symmetric heap: ${errors.map((e) => (e as Error).message).join("; ")}`,
      );
  }

  get isDisposed(): boolean {
    return this.disposed;
  }
}
