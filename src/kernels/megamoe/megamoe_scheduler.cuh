// The fused kernel's tile scheduler helpers: where a task's two rows of weight scales lie, which the
// producer (phase 4, in megamoe.cu) copies into the task slot for the math warpgroups.

#pragma once

#include "megamoe_dispatch.cuh"

namespace {

// The first of a tile's two weight-scale rows (the second is task_weight_scale_stride floats later). L1: W1 scales [E, 2I/128, H/128], rows n (gate) and I/128 + n (up);
// L2: W2 scales [E, H/128, I/128], rows 2n and 2n + 1.
__device__ __forceinline__ const float* weight_scale_rows(const Operands& op, const Task& task) {
  const bool shared = task.group == kExperts;
  const int inter = group_inter(task.group);
  if (task.kind == kTaskL1) {
    const float* expert = shared ? op.w1s_scales
                                 : op.w1_scales + static_cast<long long>(task.group) * (2 * inter / kQuant) * kHiddenBlocks;
    return expert + static_cast<long long>(task.n) * kHiddenBlocks;
  }
  const float* expert = shared ? op.w2s_scales
                               : op.w2_scales + static_cast<long long>(task.group) * kHiddenBlocks * (inter / kQuant);
  return expert + static_cast<long long>(2 * task.n) * (inter / kQuant);
}

// Floats from the first weight-scale row to the second: L1 skips I/128 rows of H/128, L2 takes the next row.
__device__ __forceinline__ int task_weight_scale_stride(const Task& task) {
  return task.kind == kTaskL1 ? (group_inter(task.group) / kQuant) * kHiddenBlocks : task.k_blocks;
}

}  // namespace
