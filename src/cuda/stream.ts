/** Streams, events and captured graphs: ordering, timing and replaying work on a device. */

import type { Device } from "./device.js";
import { check, cu, disposeSymbol, outF32, outU64 } from "./driver-api.js";
import { StreamCaptureMode } from "./driver-constants.js";

/** A CUDA stream. Work queued on it runs in order. */
export class Stream {
  readonly device: Device;
  /** The `CUstream` (0n for the legacy default stream). */
  readonly handle: bigint;
  private destroyed = false;

  /** @internal use `device.createStream()` */
  constructor(device: Device, handle: bigint) {
    this.device = device;
    this.handle = handle;
  }

  /** Wait until everything queued so far has finished. */
  synchronize(): void {
    check("cuStreamSynchronize", cu.cuStreamSynchronize(this.handle));
  }

  destroy(): void {
    if (this.destroyed || this.handle === 0n) return;
    check("cuStreamDestroy_v2", cu.cuStreamDestroy(this.handle));
    this.destroyed = true;
  }

  [disposeSymbol](): void {
    this.destroy();
  }
}

/** A CUDA event, for ordering and timing. */
export class Event {
  readonly device: Device;
  readonly handle: bigint;
  private destroyed = false;

  /** @internal use `device.createEvent()` */
  constructor(device: Device, handle: bigint) {
    this.device = device;
    this.handle = handle;
  }

  /** Record this event at the current end of `stream`. */
  record(stream: Stream): void {
    check("cuEventRecord", cu.cuEventRecord(this.handle, stream.handle));
  }

  /** Wait until the recorded work is done. */
  synchronize(): void {
    check("cuEventSynchronize", cu.cuEventSynchronize(this.handle));
  }

  /** Milliseconds between two recorded (and completed) events. */
  static elapsedMs(start: Event, end: Event): number {
    check("cuEventElapsedTime", cu.cuEventElapsedTime(outF32, start.handle, end.handle));
    return outF32[0]!;
  }

  destroy(): void {
    if (this.destroyed) return;
    check("cuEventDestroy_v2", cu.cuEventDestroy(this.handle));
    this.destroyed = true;
  }

  [disposeSymbol](): void {
    this.destroy();
  }
}

/** A captured, instantiated CUDA graph: replay a fixed sequence of launches with one call. */
export class CudaGraph {
  readonly device: Device;
  private graph: bigint;
  private exec: bigint;

  private constructor(device: Device, graph: bigint, exec: bigint) {
    this.device = device;
    this.graph = graph;
    this.exec = exec;
  }

  /**
   * Record what `body` queues on `stream` (which must not be the legacy default stream) into a graph
   * and instantiate it. Nothing runs during capture. Kernel arguments are copied at capture time, so
   * later changes to a `KernelArgs` do not affect the graph.
   */
  static capture(
    stream: Stream,
    body: (stream: Stream) => void,
    mode: number = StreamCaptureMode.THREAD_LOCAL,
  ): CudaGraph {
    if (stream.handle === 0n)
      throw new Error("CudaGraph.capture: the legacy default stream cannot be captured");
    stream.device.makeCurrent();
    check("cuStreamBeginCapture_v2", cu.cuStreamBeginCapture(stream.handle, mode));
    let bodyError: unknown;
    try {
      body(stream);
    } catch (e) {
      bodyError = e;
    }
    const endCode = cu.cuStreamEndCapture(stream.handle, outU64);
    const graph = outU64[0]!;
    if (bodyError !== undefined) {
      if (endCode === 0 && graph !== 0n) cu.cuGraphDestroy(graph);
      throw bodyError;
    }
    check("cuStreamEndCapture", endCode);
    const instantiated = cu.cuGraphInstantiateWithFlags(outU64, graph, 0n);
    if (instantiated !== 0) {
      cu.cuGraphDestroy(graph);
      check("cuGraphInstantiateWithFlags", instantiated);
    }
    return new CudaGraph(stream.device, graph, outU64[0]!);
  }

  /** Queue one replay on `stream`. */
  launch(stream: Stream): void {
    if (this.exec === 0n) throw new Error("CudaGraph used after destroy()");
    check("cuGraphLaunch", cu.cuGraphLaunch(this.exec, stream.handle));
  }

  destroy(): void {
    if (this.exec !== 0n) check("cuGraphExecDestroy", cu.cuGraphExecDestroy(this.exec));
    if (this.graph !== 0n) check("cuGraphDestroy", cu.cuGraphDestroy(this.graph));
    this.exec = 0n;
    this.graph = 0n;
  }

  [disposeSymbol](): void {
    this.destroy();
  }
}
