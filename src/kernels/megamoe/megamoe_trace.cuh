// The fused kernel's optional timeline: per-CTA words (megamoe.ts FUSED_TRACE_FIELDS mirrors the
// enum), written only when op.trace is set, so an untraced launch pays a null test per record.

#pragma once

#include "megamoe_config.cuh"

namespace {

// Per-CTA timeline words written when op.trace is set (globaltimer ns; *Ns: summed wait times).
enum Trace : int {
  kTraceEntry = 0,
  kTraceCountsReady,
  kTracePlaced,
  kTraceFirstTask,
  kTraceProducerDone,
  kTraceMathDone,
  kTraceCombineStart,
  kTraceEnd,
  kTraceDependencyWaitNs,
  kTraceStageEmptyWaitNs,
  kTraceStageFullWaitNs,
  kTraceEpilogueNs,
  kTraceL1Tiles,
  kTraceL2Tiles,
  kTraceTaskWaitNs,
  kTracePlaceClaimNs,   // thread 0's runs: the pool-row claims,
  kTracePlaceCopyNs,    // the row copies,
  kTracePlaceSignalNs,  // the fence and the arrival signals
  kTraceL2EpilogueNs,   // thread 0: the part of kTraceEpilogueNs spent in L2 tiles,
  kTracePublishNs,      // and in the fence, barrier and release that publish a tile
  kTraceL1EndLast,      // thread 0: the end of this CTA's last L1 tile,
  kTraceL2EndFirst,     // and of its first L2 tile
  kTraceL2ClaimFirst,   // the producer: its first L2 task claimed,
  kTraceL2ReadyFirst,   // and that task's rows ready (every L1 tile of the block done)
  kTraceWords = 24,
};

__device__ __forceinline__ void trace_time(unsigned long long* trace, int word) {
  if (trace != nullptr) trace[blockIdx.x * kTraceWords + word] = global_timer_ns();
}

// The first time only (the word is zeroed before a traced launch): no flag kept in registers.
__device__ __forceinline__ void trace_time_once(unsigned long long* trace, int word) {
  if (trace != nullptr && trace[blockIdx.x * kTraceWords + word] == 0ull) trace_time(trace, word);
}

__device__ __forceinline__ void trace_add(unsigned long long* trace, int word, unsigned long long v) {
  if (trace != nullptr) trace[blockIdx.x * kTraceWords + word] += v;
}

// Now, when tracing (0 otherwise: the timer read costs nothing then).
__device__ __forceinline__ unsigned long long trace_clock(const unsigned long long* trace) {
  return trace != nullptr ? global_timer_ns() : 0ull;
}

}  // namespace
