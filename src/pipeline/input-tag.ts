/**
 * The tag of a MoE input buffer: which batch its FP8 rows and its routing hold.
 *
 * In a serving step the kernel before the layer (the boundary RMSNorm, src/kernels/norm) can write the
 * FP8 rows and scales straight into the fused pipeline's input buffer, and the gate (src/kernels/gate)
 * the routing; the layer then skips its own quantization pass. That is only sound when both were written
 * for this buffer, for this row count, and nothing wrote the buffer since. The tag records exactly that
 * on the host, in the order the launches are queued (a stream orders them on the device the same way):
 *
 *   const ticket = tag.begin(rows);      // a new batch: every earlier ticket is dead
 *   ...queue the boundary kernel...;     tag.markRows(ticket);
 *   ...queue the gate...;                tag.markRouting(ticket);
 *   tag.ready(ticket, rows)              // true only now, and only for this buffer and row count
 *
 * Anything else that writes the buffer (the layer's own quantization pass, a test poisoning it) calls
 * `invalidate()`. A ticket is never valid again once a newer batch began or the buffer was invalidated.
 * Pure host state: no CUDA, so every case is tested without a GPU (test/pipeline/input-tag.test.ts).
 */

let nextBufferId = 1;

/** What a producer of the buffer holds while it writes one batch. */
export interface InputTicket {
  /** The buffer the ticket belongs to (unique per tag in this process). */
  readonly buffer: number;
  /** The batch: increases with every `begin` and `invalidate`. */
  readonly epoch: number;
  /** Rows of the batch. */
  readonly rows: number;
}

export class MoEInputTag {
  /** This buffer's identity. */
  readonly buffer = nextBufferId++;
  /** Most rows the buffer holds. */
  readonly capacity: number;
  private epoch = 0;
  private rows = 0;
  private rowsWritten = false;
  private routingWritten = false;

  constructor(capacity: number) {
    if (!Number.isInteger(capacity) || capacity < 1) {
      throw new RangeError(`MoEInputTag: capacity must be a positive integer, got ${capacity}`);
    }
    this.capacity = capacity;
  }

  /**
   * Starts a batch of `rows` rows and returns its ticket; every earlier ticket is dead from now on.
   * Throws RangeError when the batch does not fit (prefill over capacity): such a batch cannot be
   * written into the buffer and takes the layer's quantization pass.
   */
  begin(rows: number): InputTicket {
    if (!Number.isInteger(rows) || rows < 1 || rows > this.capacity) {
      throw new RangeError(
        `MoEInputTag.begin: rows must be an integer in [1, ${this.capacity}], got ${rows}`,
      );
    }
    this.epoch += 1;
    this.rows = rows;
    this.rowsWritten = false;
    this.routingWritten = false;
    return { buffer: this.buffer, epoch: this.epoch, rows };
  }

  /** Whether `ticket` is this buffer's current batch. */
  isCurrent(ticket: InputTicket): boolean {
    return ticket.buffer === this.buffer && ticket.epoch === this.epoch && ticket.rows === this.rows;
  }

  /** The FP8 rows and scales of `ticket`'s batch are queued. A dead ticket changes nothing (returns false). */
  markRows(ticket: InputTicket): boolean {
    if (!this.isCurrent(ticket)) return false;
    this.rowsWritten = true;
    return true;
  }

  /** The routing (ids, weights) of `ticket`'s batch is queued. A dead ticket changes nothing (returns false). */
  markRouting(ticket: InputTicket): boolean {
    if (!this.isCurrent(ticket)) return false;
    this.routingWritten = true;
    return true;
  }

  /**
   * True when the buffer holds `ticket`'s FP8 rows and routing, both written for this batch, and the
   * forward asks for exactly its `rows` rows (a narrowed or sliced batch does not qualify).
   */
  ready(ticket: InputTicket, rows: number): boolean {
    return this.isCurrent(ticket) && rows === ticket.rows && this.rowsWritten && this.routingWritten;
  }

  /** Something else wrote the buffer: every ticket is dead. */
  invalidate(): void {
    this.epoch += 1;
    this.rowsWritten = false;
    this.routingWritten = false;
  }
}
