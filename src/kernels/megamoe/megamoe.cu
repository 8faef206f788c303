// MegaMoE: the MoE layer after the gate as one persistent kernel launch (sm_90a).
//
// In: the token rows in FP8 (xq [T, H] e4m3, x_scales [T, H/128] fp32) and the routing (ids, weights
// [T, k]). Out: bf16 [T, H] = Σ_slots w · L2(SwiGLU(L1(x))) in slot order + the shared expert, with every
// rounding of docs/numerics.md, bit-identical to the unfused pipeline (src/pipeline/unfused.ts).
//
// Phases, all inside one launch of one CTA per SM. Every piece of work is *claimed* from a global
// counter, and a CTA claims the next phase's work only once the previous phase's counter is exhausted
// (or, with one chunk of slots, counts them itself); so every wait is on work already claimed by a
// running CTA that needs nothing from a later phase, and the kernel cannot deadlock even when fewer CTAs
// than the grid are resident.
//   1. count    chunks of the routing -> per-expert row counts (global atomics); up to 4096 slots every
//               CTA counts them all in shared memory instead, claiming its first place chunk meanwhile
//   2. offsets  every CTA scans the counts: expert e's rows in the pool are [offset[e], offset[e + 1]),
//               cut into 128-row blocks; the shared expert is one more group over all T tokens, last
//   3. place    chunks of tokens: each routed (token, slot) takes a row of its expert (global atomics),
//               its FP8 row and scales are copied into the pool (scales transposed for TMA), and the
//               row's block counts its arrival (release); slot_row[token, slot] = pool row or −1
//   4. tiles    a producer thread claims tasks: all L1 tiles (pool block × 128 channels of gate and up),
//               then all L2 tiles (pool block × 256 output columns); it hands each task to the math
//               warpgroups through a 2-slot shared-memory ring and streams the tile's A, A scales and B
//               through the stage ring (TMA, mbarriers). Before an L1 tile's rows it waits for their
//               arrival; before an L2 tile's rows it waits until every L1 tile of the block is done. The
//               B tiles (weights) of the first stages are requested before that wait, so weight
//               streaming overlaps it.
//               L1 epilogue: gate and up of the same channels sit in one tile, so SwiGLU, the per-128
//               amax and the FP8 re-quantization happen in registers; the h rows and scales go to the
//               intermediate pool and the block's L1 counter is bumped (release).
//               L2 epilogue: bf16 rows to y [rows, H].
//   5. combine  once every L2 tile is done: per token, Σ_slots w · y[slot_row] in slot order, + the shared
//               expert's y row, rounded once to bf16.
//   The last CTA to finish zeroes the workspace for the next launch.
//
// Every wait is bounded (kWatchdogNs): a wait that outlasts it records what it waited for in `status`
// and traps, so a bug ends the launch with an error instead of hanging the GPU (report() says why a
// trap and not an exit).
//
// Compile-time parameters (-D, from megamoe.variants.ts): HIDDEN, INTER (routed experts' intermediate),
// SHARED_INTER (the shared expert's, 0: none), NUM_EXPERTS, TOP_K, BLOCK_M (128, 64, or 32 and 16 for the
// swap-AB tiles of decode), NUM_STAGES, SCALE_UE8M0, B_FP4 (MXFP4 routed experts, converted on chip by
// warps 1..3 of the producer warpgroup: docs/design.md "FP4 experts"), and SHARED_BYTES (the launcher's
// figure for the layout in megamoe_layout.cuh, checked against it).
//
// The parts: megamoe_config.cuh (the parameters), megamoe_layout.cuh (shared memory, workspace,
// operands), megamoe_sync.cuh (claims and the watchdog), megamoe_trace.cuh, megamoe_dispatch.cuh (phases
// 1-3), megamoe_scheduler.cuh (a task's weight scales), megamoe_mainloop.cuh and megamoe_epilogue.cuh
// (phase 4's math), megamoe_combine.cuh (phase 5). The kernel below runs the phases in order; the count,
// offsets, producer and math loops stay inline in it because moving them into functions changed the
// SASS ptxas emits (the place phase and the workspace reset did not).
#include "megamoe_combine.cuh"
#include "megamoe_ep.cuh"
#include "megamoe_epilogue.cuh"
#include "megamoe_expand.cuh"
#include "megamoe_scheduler.cuh"

// ---------------------------------------------------------------------------------------------------
// The kernel. Launch: grid = SM count (or fewer), block = kThreads, dynamic shared memory =
// kDynamicSmemBytes (megamoe.variants.ts: fusedSharedBytes).

extern "C" __global__ void __launch_bounds__(kThreads, 1)
    megamoe_fused(const __grid_constant__ TensorMap map_pool_x, const __grid_constant__ TensorMap map_pool_x_scales,
                  const __grid_constant__ TensorMap map_w1, const __grid_constant__ TensorMap map_w1s,
                  const __grid_constant__ TensorMap map_pool_h, const __grid_constant__ TensorMap map_pool_h_scales,
                  const __grid_constant__ TensorMap map_w2, const __grid_constant__ TensorMap map_w2s,
#if B_FP4
                  // The routed experts' UE8M0 words (map_w1 and map_w2 are then their packed nibbles).
                  const __grid_constant__ TensorMap map_w1_words, const __grid_constant__ TensorMap map_w2_words,
#endif
                  const Operands op
#if EP_RANKS > 1
                  // Expert parallelism (megamoe_ep.cuh): this launch is one rank; peers through the table.
                  , const __grid_constant__ EpOperands ep
#endif
                  ) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw = smem_u32(smem_raw);
  const unsigned base = (raw + kSmemAlign - 1) & ~(kSmemAlign - 1);
  unsigned char* const smem = smem_raw + (base - raw);
  int* const offsets = reinterpret_cast<int*>(smem + kOffOffsets);
  int* const blocks = reinterpret_cast<int*>(smem + kOffBlocks);
  int* const hist = reinterpret_cast<int*>(smem + kOffHist);
  int* const broadcast = reinterpret_cast<int*>(smem + kOffBroadcast);
  const unsigned full_bar = base + kOffBars;
  const unsigned empty_bar = full_bar + 8 * kStages;
  const unsigned task_full_bar = empty_bar + 8 * kStages;
  const unsigned task_empty_bar = task_full_bar + 16;
  const unsigned loaded_bar = task_empty_bar + 16;  // FP4 builds with converters, or the expansion's

  int* const ws = op.workspace;
  int* const counts = ws + kCounterWords;
  int* const cursor = counts + kGroups;
  int* const arrived = cursor + kGroups;
  int* const l1_done = arrived + op.max_blocks;
  int* const expanded = l1_done + op.max_blocks;
  const SharedState cta{smem, base, offsets, blocks, hist, broadcast, full_bar, empty_bar, task_full_bar, task_empty_bar};
  const Workspace work{ws, counts, cursor, arrived, l1_done, expanded};
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int slots = op.tokens * kTopK;

  unsigned dynamic_bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
  if (dynamic_bytes < kDynamicSmemBytes) {  // launched with another build's layout
    if (tid == 0) report(op.status, kStatusSharedMemoryTooSmall, static_cast<int>(dynamic_bytes), kDynamicSmemBytes);
    return;
  }
  if (tid == 0) trace_time(op.trace, kTraceEntry);
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      // FP4 with converters: the producer's arrive.expect_tx and one arrive per converter warp.
      mbar_init(full_bar + 8 * s, kConverters ? 1 + kConverterWarps : 1);
      mbar_init(empty_bar + 8 * s, kMathWarps);
      if constexpr (kConverters) mbar_init(loaded_bar + 8 * s, 1);
    }
    if constexpr (kExpand) mbar_init(loaded_bar, 1);
    for (int s = 0; s < 2; ++s) {
      mbar_init(task_full_bar + 8 * s, 1);
      mbar_init(task_empty_bar + 8 * s, kMathThreads);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (tid == kMathThreads) {
    prefetch_tensor_map(&map_pool_x);
    prefetch_tensor_map(&map_pool_x_scales);
    prefetch_tensor_map(&map_w1);
    prefetch_tensor_map(&map_pool_h);
    prefetch_tensor_map(&map_pool_h_scales);
    prefetch_tensor_map(&map_w2);
#if B_FP4
    prefetch_tensor_map(&map_w1_words);
    prefetch_tensor_map(&map_w2_words);
#endif
  }
  // Launched after the kernel that wrote the rows (quantization, the norm or the gate) with programmatic
  // stream serialization: the launch and the prologue above overlap its tail; nothing it wrote, and no
  // operand, is read before this.
  megamoe::wait_for_previous_grid();

#if EP_RANKS > 1
  // ---- 1-3. count, describe, publish; offsets; place (megamoe_ep.cuh)
  (void)slots;  // the EP count reads the routing per token
  const unsigned epoch = ep_publish(op, ep, cta);
  const int shared_rows = op.use_shared != 0 && kSharedInter > 0 ? op.tokens : 0;
  ep_offsets(ep, cta, epoch, shared_rows);
  ep_place(op, ep, work, cta, epoch, shared_rows);
#else
  // ---- 1. count
  // One chunk's worth of slots (decode and mid T): every CTA counts them all in its own histogram, so
  // none waits for another's atomics, and claims its first placement chunk meanwhile (the claim needs no
  // count; the chunk's work needs only this CTA's). More: chunks counted by the grid into the workspace.
  const bool local_counts = slots <= kCountChunkSlots;
  const int count_chunks = local_counts ? 1 : (slots + kCountChunkSlots - 1) / kCountChunkSlots;
  if (local_counts && tid == 0) broadcast[1] = atomicAdd(ws + kPlaceClaim, 1);
  for (;;) {
    const int chunk = local_counts ? 0 : cta_claim(ws + kCountClaim, broadcast);
    if (chunk >= count_chunks) break;
    count_slots(op, hist, chunk * kCountChunkSlots, min(slots, (chunk + 1) * kCountChunkSlots));
    if (local_counts) break;  // the histogram is the counts
    __syncthreads();
    for (int g = tid; g < kExperts; g += kThreads) {
      if (hist[g] != 0) atomicAdd(counts + g, hist[g]);
    }
    __syncthreads();
    if (tid == 0) add_release(ws + kCountDone, 1);
  }

  // ---- 2. offsets (every CTA, from the finished counts)
  if (tid == 0) {
    if (!local_counts) wait_at_least(ws + kCountDone, count_chunks, op.status, kStatusCountWait, count_chunks);
    trace_time(op.trace, kTraceCountsReady);
  }
  __syncthreads();
  const int shared_rows = op.use_shared != 0 && kSharedInter > 0 ? op.tokens : 0;
  if (warp == 0) {
    if (local_counts) build_groups<true>(hist, shared_rows, offsets, blocks);
    else build_groups<false>(counts, shared_rows, offsets, blocks);
  }
  __syncthreads();

  const int place_chunks = place_rows(op, work, cta, shared_rows, local_counts);
#endif

  if (tid == 0) trace_time(op.trace, kTracePlaced);

  // ---- 4. tiles
  const int total_blocks = blocks[kGroups];
  const int routed_blocks = blocks[kExperts];
  const int routed_l1 = routed_blocks * (kInter / kQuant);
  const int total_l1 = routed_l1 + (total_blocks - routed_blocks) * (kSharedInter / kQuant);
  const int total_l2 = total_blocks * kL2TilesPerBlock;
  const int total_tasks = total_l1 + total_l2;

  if (warp >= kMathWarps) {
    // ---------------- Producer: one thread claims tasks and streams their operands.
    registers_decrease<kProducerRegisters>();
    const unsigned stage_kinds = base + kOffStageKinds;  // FP4 builds: a StageKind per stage
    if (tid != kMathThreads) {
      const int converter = tid - kMathThreads - 32;
      if (kConverters && converter >= 0) {
        // ---------------- FP4 converters (warps 1..3): each routed stage's packed rows into the B tile,
        // in ring order; a stage of FP8 weights (the shared expert) passes through untouched. (Inside
        // this branch rather than before it: there ptxas spilled the producer thread's registers.)
        int stage = 0;
        unsigned phase = 0;
        for (;;) {
          wait_barrier(loaded_bar + 8 * stage, phase, op.status, kStatusConvertWait, stage);
          const int kind = static_cast<int>(load_shared_u32(stage_kinds + 4 * stage));
          if (kind == kStageStop) break;
          if (kind == kStageFp4) {
            megamoe::fp4_stage::convert_tile<kBlockN, kConverterThreads, kConvertDepth>(
                base + kOffPacked + stage * kPackedStageBytes, base + kOffRowWords + stage * kRowWordsStageBytes,
                base + kOffB + stage * kBTileBytes, converter);
            // The wgmmas read the tile through the async proxy: order these generic writes before them.
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
          }
          __syncwarp();
          if (lane == 0) mbar_arrive(full_bar + 8 * stage);
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1u;
          }
        }
      }
#if FP4_EXPAND
      // ---------------- Expansion workers (warps 1..3): the routed stages' images (megamoe_expand.cuh).
      if (converter >= 0) {
        expand_worker(op, work, cta, &map_w1, &map_w2, &map_w1_words, &map_w2_words, loaded_bar, converter);
      }
#endif
      return;
    }
    int stage = 0;
    unsigned phase = 0;
    int slot = 0;
    unsigned slot_phase = 0;
    bool first = true;
    for (;;) {
      const int claimed = atomicAdd(ws + kTaskClaim, 1);
      if (first) trace_time(op.trace, kTraceFirstTask);
      first = false;
      wait_barrier(task_empty_bar + 8 * slot, slot_phase ^ 1u, op.status, kStatusTaskWait, slot);
      Task task{};
      if (claimed < total_tasks) {
        int local;
        int per_block;
        if (claimed < total_l1) {
          task.kind = kTaskL1;
          const bool shared = claimed >= routed_l1;
          per_block = (shared ? kSharedInter : kInter) / kQuant;
          local = shared ? claimed - routed_l1 : claimed;
          task.block = (shared ? routed_blocks : 0) + local / per_block;
        } else {
          task.kind = kTaskL2;
          per_block = kL2TilesPerBlock;
          local = claimed - total_l1;
          task.block = local / per_block;
        }
        task.n = local % per_block;
        task.group = group_of_block(blocks, task.block);
        task.row0 = offsets[task.group] + (task.block - blocks[task.group]) * kBlockM;
        task.row_end = offsets[task.group + 1];
        task.k_blocks = task.kind == kTaskL1 ? kHiddenBlocks : group_inter(task.group) / kQuant;
      }
      *reinterpret_cast<Task*>(smem + kOffTasks + slot * kTaskSlotBytes) = task;
      // FP4 register tiles promote with each row's scale from its reference word, so they need none.
      if (task.kind != kTaskNone && !(kFp4Regs && task.group != kExperts)) {
        // The tile's two weight-scale rows, so the math warpgroups start the tile without a global load.
        float* sw = reinterpret_cast<float*>(smem + kOffTasks + slot * kTaskSlotBytes + 32);
        const float* rows = weight_scale_rows(op, task);
        const int stride = task_weight_scale_stride(task);
#pragma unroll 8
        for (int kb = 0; kb < task.k_blocks; ++kb) {
          sw[kb] = load_scale(rows + kb);
          sw[kMaxKBlocks + kb] = load_scale(rows + stride + kb);
        }
      }
      mbar_arrive(task_full_bar + 8 * slot);
      if (++slot == 2) {
        slot = 0;
        slot_phase ^= 1u;
      }
      if (task.kind == kTaskNone) {
        trace_time(op.trace, kTraceProducerDone);
        if constexpr (kConverters) {
          // The converters leave through the next stage, once they have passed its previous use.
          wait_barrier(empty_bar + 8 * stage, phase ^ 1u, op.status, kStatusStageEmptyWait, stage);
          store_shared_u32(stage_kinds + 4 * stage, kStageStop);
          mbar_arrive(loaded_bar + 8 * stage);
        }
        break;
      }

      const bool l1 = task.kind == kTaskL1;
      const bool shared = task.group == kExperts;
      const int inter = group_inter(task.group);
      if (!l1) trace_time_once(op.trace, kTraceL2ClaimFirst);
      const TensorMap* map_a = l1 ? &map_pool_x : &map_pool_h;
      const TensorMap* map_sa = l1 ? &map_pool_x_scales : &map_pool_h_scales;
      const TensorMap* map_b = l1 ? (shared ? &map_w1s : &map_w1) : (shared ? &map_w2s : &map_w2);
      const int expert = shared ? 0 : task.group;
      // FP4 builds: the routed experts' B arrives packed (to `loaded`, for the converters), A to `full`.
      const bool fp4 = kBFp4 && !shared;
      const int b_row0 = tile_b_row0(l1, expert, task.n, inter);
      const int b_row1 = tile_b_row1(l1, b_row0, inter);
      if constexpr (kExpand) {
        if (fp4) {
          // Expand builds: the expert's images are written (by any CTA) before the first copy.
          wait_at_least(work.expanded + (l1 ? 0 : kExperts) + expert, expand_chunks_per_expert(l1), op.status,
                        kStatusExpandWait, expert);
          fence_proxy_async_global();
        }
      }
      // FP4: a stage's packed rows and their UE8M0 words, to `loaded` (the converters complete `full`);
      // expand builds: the stage's image, the e4m3 tile, to `full` (A arrives there).
      const auto load_fp4_weights = [&](int s, int kb) {
#if B_FP4
        if constexpr (kExpand) {
          const unsigned bar = full_bar + 8 * s;
          // The image from the B row, opaque (live for the loads anyway): keeping the expert and tile, or
          // hoisting the address out of the stage loop, made ptxas spill the producer.
          const int chunk = expand_chunk_of_row(l1, opaque_i32(b_row0), kb);
          const unsigned char* image = op.images + static_cast<size_t>(chunk) * kImageBytes;
          mbar_expect_tx(bar, kExpandedTxBytes);
          bulk_load(base + kOffB + s * kBTileBytes, image, kBTileBytes, bar);
        } else {
          const TensorMap* map_words = l1 ? &map_w1_words : &map_w2_words;
          const unsigned bar = loaded_bar + 8 * s;
          const unsigned packed = base + kOffPacked + s * kPackedStageBytes;
          const unsigned words = base + kOffRowWords + s * kRowWordsStageBytes;
          store_shared_u32(stage_kinds + 4 * s, kStageFp4);
          mbar_arrive_expect_tx(bar, kFp4LoadedTxBytes);
          load_packed_stage(packed, words, map_b, map_words, bar, kb, b_row0, b_row1);
        }
#endif
      };
      // FP4 builds, a stage of FP8 weights: the converters only pass it on to `full`.
      const auto pass_fp8_weights = [&](int s) {
        if constexpr (kConverters) {
          store_shared_u32(stage_kinds + 4 * s, kStageFp8);
          mbar_arrive(loaded_bar + 8 * s);
        }
      };
      if constexpr (kFp4Regs) {
        // Swap-AB FP4 (the math threads convert): a routed K block is one stage, its packed rows and
        // words (64-byte swizzle, fp4_frag.cuh), A and A scales, all to `full`. A shared-expert K block
        // is two: step 2kb brings B box 0 with A, step 2kb + 1 box 1, each into the stage's packed area.
        const int steps = fp4 ? task.k_blocks : 2 * task.k_blocks;
        const int early = steps < kEarlyStages ? steps : kEarlyStages;
        const int first_stage = stage;
        const auto load_a = [&](int s, int step) {
          const unsigned b = full_bar + 8 * s;
          const int kb = fp4 ? step : step >> 1;
          tma_load_2d(base + kOffA + s * kATileBytes, map_a, b, kb * kBlockK, task.row0);
          tma_load_2d(base + kOffSa + s * kSaStride, map_sa, b, task.row0 & ~3, kb);
        };
        for (int step = 0; step < steps; ++step) {
          const unsigned long long t_empty = trace_clock(op.trace);
          wait_barrier(empty_bar + 8 * stage, phase ^ 1u, op.status, kStatusStageEmptyWait, stage);
          trace_add(op.trace, kTraceStageEmptyWaitNs, trace_clock(op.trace) - t_empty);
          const unsigned bar = full_bar + 8 * stage;
          const unsigned weights = base + kOffPacked + stage * kPackedStageBytes;
          const bool with_a = fp4 || (step & 1) == 0;
          // Weights first (they do not depend on other CTAs); the rows' bytes are expected with them.
          mbar_arrive_expect_tx(bar, fp4 ? kFp4RegsTxBytes : kBHalfBytes + (with_a ? kFp4FullTxBytes : 0u));
          if (fp4) {
#if B_FP4
            const TensorMap* map_words = l1 ? &map_w1_words : &map_w2_words;
            const unsigned words = base + kOffRowWords + stage * kRowWordsStageBytes;
            load_packed_stage(weights, words, map_b, map_words, bar, step, b_row0, b_row1);
#endif
          } else {
            tma_load_2d(weights, map_b, bar, step / 2 * kBlockK, (step & 1) == 0 ? b_row0 : b_row1);
          }
          if (step == early - 1) {
            // Then the rows: arrived (L1) or produced by every L1 tile of the block (L2).
            const unsigned long long t_dep = trace_clock(op.trace);
            if (l1) {
              const int rows = min(kBlockM, task.row_end - task.row0);
              wait_at_least(arrived + task.block, rows, op.status, kStatusArrivalWait, task.block);
            } else {
              wait_at_least(l1_done + task.block, inter / kQuant * kPublishesPerTile, op.status, kStatusL1Wait,
                            task.block);
            }
            trace_add(op.trace, kTraceDependencyWaitNs, trace_clock(op.trace) - t_dep);
            if (!l1) trace_time_once(op.trace, kTraceL2ReadyFirst);
            fence_proxy_async_global();
            int s = first_stage;
            for (int k = 0; k < early; ++k) {
              if (fp4 || (k & 1) == 0) load_a(s, k);
              if (++s == kStages) s = 0;
            }
          } else if (step >= early && with_a) {
            load_a(stage, step);
          }
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1u;
          }
        }
        continue;
      }
      const int early = task.k_blocks < kEarlyStages ? task.k_blocks : kEarlyStages;
      const int first_stage = stage;
      for (int kb = 0; kb < task.k_blocks; ++kb) {
        const unsigned long long t_empty = trace_clock(op.trace);
        wait_barrier(empty_bar + 8 * stage, phase ^ 1u, op.status, kStatusStageEmptyWait, stage);
        trace_add(op.trace, kTraceStageEmptyWaitNs, trace_clock(op.trace) - t_empty);
        const unsigned bar = full_bar + 8 * stage;
        if (kb < early) {
          // Weights first: they do not depend on other CTAs.
          if (fp4) {
            load_fp4_weights(stage, kb);
          } else {
            mbar_arrive_expect_tx(bar, kStageTxBytes);
            tma_load_2d(base + kOffB + stage * kBTileBytes, map_b, bar, kb * kBlockK, b_row0);
            tma_load_2d(base + kOffB + stage * kBTileBytes + kBHalfBytes, map_b, bar, kb * kBlockK, b_row1);
            pass_fp8_weights(stage);
          }
        }
        if (kb == early - 1) {
          // Then the rows: arrived (L1) or produced by every L1 tile of the block (L2).
          const unsigned long long t_dep = trace_clock(op.trace);
          if (l1) {
            const int rows = min(kBlockM, task.row_end - task.row0);
            wait_at_least(arrived + task.block, rows, op.status, kStatusArrivalWait, task.block);
          } else {
            wait_at_least(l1_done + task.block, inter / kQuant * kPublishesPerTile, op.status, kStatusL1Wait,
                          task.block);
          }
          trace_add(op.trace, kTraceDependencyWaitNs, trace_clock(op.trace) - t_dep);
          if (!l1) trace_time_once(op.trace, kTraceL2ReadyFirst);
          fence_proxy_async_global();
          int s = first_stage;
          for (int k = 0; k < early; ++k) {
            const unsigned b = full_bar + 8 * s;
            if (fp4) mbar_arrive_expect_tx(b, kFp4FullTxBytes);
            tma_load_2d(base + kOffA + s * kATileBytes, map_a, b, k * kBlockK, task.row0);
            tma_load_2d(base + kOffSa + s * kSaStride, map_sa, b, task.row0 & ~3, k);
            if (++s == kStages) s = 0;
          }
        }
        if (kb >= early) {
          if (fp4) load_fp4_weights(stage, kb);
          mbar_arrive_expect_tx(bar, fp4 ? kFp4FullTxBytes : kStageTxBytes);
          tma_load_2d(base + kOffA + stage * kATileBytes, map_a, bar, kb * kBlockK, task.row0);
          tma_load_2d(base + kOffSa + stage * kSaStride, map_sa, bar, task.row0 & ~3, kb);
          if (!fp4) {
            tma_load_2d(base + kOffB + stage * kBTileBytes, map_b, bar, kb * kBlockK, b_row0);
            tma_load_2d(base + kOffB + stage * kBTileBytes + kBHalfBytes, map_b, bar, kb * kBlockK, b_row1);
            pass_fp8_weights(stage);
          }
        }
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1u;
        }
      }
    }
    return;
  }

  // ---------------- Math warpgroups.
  registers_increase<kMathRegisters>();
  const int warpgroup = tid / 128;
  const int frag_row = ((tid / 32) & 3) * 16 + lane / 4;
  const int frag_col = 2 * (lane & 3);
  const int row_offset = warpgroup_row_offset(warpgroup);  // the same for both kinds
  const MathContext m{base + kOffA + static_cast<unsigned>(row_offset) * kBlockK,
                      base + (kFp4Regs ? kOffPacked : kOffB),
                      base + kOffSa + (kSwapAB ? 0u : static_cast<unsigned>(row_offset + frag_row) * 4),
                      base + kOffRowWords,
                      full_bar,
                      empty_bar,
                      base + kOffAmax,
                      base + kOffStaging + static_cast<unsigned>(warp) * kStagingWarpBytes,
                      base + kOffStaging,
                      warpgroup,
                      lane,
                      op.status,
                      op.trace};
  int stage = 0;
  unsigned phase = 0;
  int slot = 0;
  unsigned slot_phase = 0;
  float acc[2][kAccum];
  for (;;) {
    const unsigned long long t_task = trace_clock(op.trace);
    wait_barrier(task_full_bar + 8 * slot, slot_phase, op.status, kStatusTaskWait, slot);
    if (tid == 0) trace_add(op.trace, kTraceTaskWaitNs, trace_clock(op.trace) - t_task);
    const Task task = *reinterpret_cast<const Task*>(smem + kOffTasks + slot * kTaskSlotBytes);
    const unsigned sw_rows = base + kOffTasks + slot * kTaskSlotBytes + 32;
    const unsigned task_empty = task_empty_bar + 8 * slot;
    if (++slot == 2) {
      slot = 0;
      slot_phase ^= 1u;
    }
    if (task.kind == kTaskNone) break;
    const bool l1 = task.kind == kTaskL1;

    // Where both kinds split alike the L1 mainloop serves both: one copy, a smaller loop for the
    // instruction cache.
    if constexpr (kSwapAB) {
      if (kKindsSplitAlike || l1) swap_mainloop<true>(m, task, sw_rows, stage, phase, acc, frag_col);
      else swap_mainloop<false>(m, task, sw_rows, stage, phase, acc, frag_col);
    } else {
      if (kKindsSplitAlike || l1) tile_mainloop<true>(m, task, sw_rows, stage, phase, acc);
      else tile_mainloop<false>(m, task, sw_rows, stage, phase, acc);
    }
    // The slot (task and weight scales) is read: the producer may reuse it. Every reader arrives (an
    // arrive releases only its own thread's reads), once per tile.
    mbar_arrive(task_empty);
    const unsigned long long t_epilogue = trace_clock(op.trace);
    if constexpr (kSwapAB) {
      if (l1) l1_epilogue_swap(op, m, task, acc, frag_row, frag_col);
      else l2_epilogue_swap(op, m, task, acc, frag_row, frag_col);
    } else {
      if (l1) l1_epilogue(op, m, task, acc, frag_row, frag_col);
      else l2_epilogue(op, m, task, acc, frag_row, frag_col);
    }
    const unsigned long long t_publish = trace_clock(op.trace);
    // L1's h rows are read by TMA (the async proxy) in other CTAs; L2's y rows only by plain loads.
    if (l1) fence_proxy_async_global();
    if constexpr (kWarpgroupPublish) named_barrier_sync(3 + warpgroup, 128);
    else named_barrier_sync(1, kMathThreads);
    if (tid % (kWarpgroupPublish ? 128 : kMathThreads) == 0) add_release(l1 ? l1_done + task.block : ws + kL2Done, 1);
    if (tid == 0) {
      const unsigned long long t_end = trace_clock(op.trace);
      trace_add(op.trace, kTraceEpilogueNs, t_end - t_epilogue);
      trace_add(op.trace, kTracePublishNs, t_end - t_publish);
      if (!l1) trace_add(op.trace, kTraceL2EpilogueNs, t_end - t_epilogue);
      trace_add(op.trace, l1 ? kTraceL1Tiles : kTraceL2Tiles, 1);
      if (l1) trace_time(op.trace, kTraceL1EndLast);
      else trace_time_once(op.trace, kTraceL2EndFirst);
    }
  }
  if (tid == 0) trace_time(op.trace, kTraceMathDone);

#if EP_RANKS > 1
  // ---- 5. push the results to the token owners, combine this rank's tokens, reset
  ep_push(op, ep, cta, total_l2);
  ep_combine(op, ep, cta, epoch, shared_rows);
  if constexpr (kExpand) named_barrier_sync(kExpandDoneBarrier, kMathThreads + kExpandThreads);
  zero_workspace_if_last(op, work, cta, total_blocks);
  ep_reset_if_last(ep, cta, epoch);
#else
  // ---- 5. combine
  if (tid == 0) {
    wait_at_least(ws + kPlaceDone, place_chunks, op.status, kStatusCombineWait, 0);
    wait_at_least(ws + kL2Done, total_l2 * kPublishesPerTile, op.status, kStatusCombineWait, 1);
    trace_time(op.trace, kTraceCombineStart);
  }
  named_barrier_sync(1, kMathThreads);  // thread 0's waits cover the CTA
  const int shared_row0 = shared_rows > 0 ? offsets[kExperts] : -1;
  // Every CTA reaches this point within a microsecond of the others (the last L2 tiles end together),
  // so the work is dealt to the grid's math warps in turn rather than claimed. With fewer tokens than
  // warps a token's channels are split into segments, so that small batches use the whole grid too.
  const int grid_warps = static_cast<int>(gridDim.x) * kMathWarps;
  const int segments = max(1, min(kCombineChunks, grid_warps / op.tokens));
  for (int unit = static_cast<int>(blockIdx.x) * kMathWarps + warp; unit < op.tokens * segments;
       unit += grid_warps) {
    const int segment = unit % segments;
    combine_token(op, shared_row0, unit / segments, segment * kCombineChunks / segments,
                  (segment + 1) * kCombineChunks / segments, lane);
  }

  if constexpr (kExpand) named_barrier_sync(kExpandDoneBarrier, kMathThreads + kExpandThreads);
  zero_workspace_if_last(op, work, cta, total_blocks);
#endif
}
