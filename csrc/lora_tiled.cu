// Segment-tiled path (prefill, large batches; fp16/bf16, max_rank <= 128): a block takes kTileRows consecutive
// positions of sorted_token_ids, so the tokens of one adapter share every factor tile it loads, and multiplies
// on tensor cores (mma.sync m16n8k16, fp32 accumulators). The tile's rows fall into runs of one slot each
// (usually one or two); a block makes one pass per run with rank > 0, masking the rows of other runs in the
// operand registers, so all passes accumulate into the same registers.
//   shrink: grid (tiles, K splits), 4 warps of 16 rows; x rows and A rows (from the pool) stream through a
//           kStages-deep cp.async pipeline of kStepK-wide K steps, one sequence over all (run, step) pairs;
//           writes fp32 partials v_partial[split, position, r] (zero where nothing applies).
//   expand: grid (tiles, column groups), 8 warps of 16 rows x 128 columns; a block streams several column
//           chunks of kTileCols through double-buffered y tiles, Bt tile [rank rows x kTileCols] (row-major, as the
//           pool holds it) per run, v = sum of the splits rounded to the input dtype once per block (as PEFT's
//           B(A x) rounds it), y rows += v . Bt written back with 16-byte stores.
// The expand is a programmatic dependent of the shrink: everything up to the v tile overlaps the shrink.
#include "kernel_common.cuh"

namespace punica {
namespace {

constexpr int kTileRows = 64;                  // sorted positions per block
constexpr int kShrinkWarps = kTileRows / 16;   // one 16-row MMA block each
constexpr int kShrinkThreads = kShrinkWarps * 32;
constexpr int kStepK = 128;                    // shrink: input elements per pipeline stage
constexpr int kStages = 4;                     // shrink: cp.async stages, kStages - 1 in flight
constexpr int kLdK = kStepK + 8;               // shrink stage row stride (elements): ldmatrix rows hit distinct banks
constexpr int kTileCols = 256;                 // expand: output columns per block
constexpr int kExpandWarps = 8;                // 4 row blocks x 2 column halves
constexpr int kExpandThreads = kExpandWarps * 32;
constexpr int kWarpCols = kTileCols / 2;       // expand: columns per warp (16 MMA fragments of 8)
constexpr int kLdOut = kTileCols + 8;          // expand y / Bt tile row stride (elements)
constexpr int kMaxFragments = kTiledMaxRank / 8;
constexpr int kSumBatch = 4;                   // expand: K-split partials a thread loads at once
constexpr size_t kSmemForTwoBlocks = 110 * 1024;  // two blocks of this much shared memory fit a multiprocessor

__host__ __device__ constexpr int round_up_16(int value) { return (value + 15) / 16 * 16; }

// The tile's rows grouped into runs of one slot (sorted positions of one adapter are contiguous).
struct TileRuns {
  int tokens[kTileRows];    // token id of each row (rows past num_tokens: 0, never read through)
  int slots[kTileRows];     // slot of each row, -1 = none (also rows past num_tokens)
  int row_rank[kTileRows];  // rank of each row's slot: 0 = the row is left alone
  unsigned run_starts[2], active_starts[2];  // bit masks over the 64 rows (two words)
  int count;                // runs with rank > 0, in row order:
  int begin[kTileRows], end[kTileRows], rank[kTileRows];
  int64_t offset[kTileRows];
};

// Rows' token ids and slots (one load each, both in flight); all threads call it (rows: the first kTileRows
// threads), a barrier publishes them.
__device__ __forceinline__ void load_tile_tokens(const int32_t* sorted_token_ids, const int32_t* sorted_slots,
                                                 int num_tokens, int num_slots, int tile_start, TileRuns& runs) {
  if (threadIdx.x < kTileRows) {
    const int position = tile_start + threadIdx.x;
    int token = 0, slot = -1;
    if (position < num_tokens) {
      token = sorted_token_ids[position];
      slot = sorted_slots[position];
      if (slot < 0 || slot >= num_slots) slot = -1;
    }
    runs.tokens[threadIdx.x] = token;
    runs.slots[threadIdx.x] = slot;
  }
  __syncthreads();
}

// Ranks and factor offsets of the rows' slots, then the active runs; all threads call it (after
// load_tile_tokens), barriers inside and at the end.
__device__ __forceinline__ void find_runs(const int32_t* lora_ranks, const int64_t* offsets, int max_rank,
                                          TileRuns& runs) {
  const int row = threadIdx.x;
  int slot = -1, rank = 0;
  int64_t offset = 0;
  if (row < kTileRows) {
    slot = runs.slots[row];
    if (slot >= 0) {  // both loads in flight together; the offset is used only if rank > 0
      rank = rank_of(lora_ranks, slot, max_rank);
      offset = offsets[slot];
    }
    runs.row_rank[row] = rank;  // read after the barriers below
  }
  if (row < kTileRows) {  // warps 0 and 1, whole warps: one ballot word each (slots published by load_tile_tokens)
    const bool run_start = row == 0 || runs.slots[row - 1] != slot;
    const unsigned starts = __ballot_sync(kFullMask, run_start);
    const unsigned active = __ballot_sync(kFullMask, run_start && rank > 0);
    if (row % 32 == 0) {
      runs.run_starts[row / 32] = starts;
      runs.active_starts[row / 32] = active;
    }
  }
  __syncthreads();
  if (row < kTileRows) {
    const uint64_t starts = runs.run_starts[0] | static_cast<uint64_t>(runs.run_starts[1]) << 32;
    const uint64_t active = runs.active_starts[0] | static_cast<uint64_t>(runs.active_starts[1]) << 32;
    if (row == 0) runs.count = __popcll(active);
    if ((active >> row) & 1) {
      const int index = __popcll(active & ((uint64_t{1} << row) - 1));
      const uint64_t later_starts = row + 1 < kTileRows ? starts >> (row + 1) : 0;
      runs.begin[index] = row;
      runs.end[index] = later_starts ? row + __ffsll(static_cast<long long>(later_starts)) : kTileRows;
      runs.rank[index] = rank;
      runs.offset[index] = offset;
    }
  }
  __syncthreads();
}

// ldmatrix: four 8x8 b16 matrices, lane l gives the row address of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&regs)[4], const void* smem_row) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
               : "r"(address));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&regs)[4], const void* smem_row) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
               : "r"(address));
}

// acc (16x8 fp32) += a (16x16, row-major) . b (16x8, column-major); T = __half or __nv_bfloat16.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&acc)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&acc)[4], const unsigned (&a)[4], unsigned b0,
                                                         unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&acc)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Zeroes the A-operand rows of a 16-row block outside [begin, end): lane holds rows first + g and first + g + 8.
__device__ __forceinline__ void mask_rows(unsigned (&a)[4], int first_row, int begin, int end) {
  const int low = first_row + (threadIdx.x % 32) / 4, high = low + 8;
  if (low < begin || low >= end) a[0] = a[2] = 0;
  if (high < begin || high >= end) a[1] = a[3] = 0;
}

template <typename T>
__global__ void __launch_bounds__(kShrinkThreads)
shrink_tiled_kernel(const T* __restrict__ x, const T* __restrict__ pool, const int64_t* __restrict__ a_offsets,
                    const int32_t* __restrict__ lora_ranks, const int32_t* __restrict__ sorted_token_ids,
                    const int32_t* __restrict__ sorted_slots, float* __restrict__ v_partial, int num_tokens,
                    int num_tokens_pad, int hidden_in, int max_rank, int rank_pad, int num_slots, int k_chunk) {
  allow_dependent_launch();
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ TileRuns runs;
  T* stages = reinterpret_cast<T*>(smem_raw);  // [kStages][kTileRows + rank_pad][kLdK]: x rows, then A rows
  const int stage_elems = (kTileRows + rank_pad) * kLdK;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int tile_start = blockIdx.x * kTileRows;
  const int split = blockIdx.y;
  const int k_begin = split * k_chunk;
  const int k_end = min(hidden_in, k_begin + k_chunk);
  const int num_steps = (k_end - k_begin + kStepK - 1) / kStepK;

  load_tile_tokens(sorted_token_ids, sorted_slots, num_tokens, num_slots, tile_start, runs);
  find_runs(lora_ranks, a_offsets, max_rank, runs);
  const int total_stages = runs.count * num_steps;  // stage s: run s / num_steps, K step s % num_steps

  // Stage s into buffer `buffer`: the run's x rows (other rows are masked in registers, never read as data)
  // and its A rows up to the rank rounded to 16 (zero past the rank), zero past k_end.
  auto load_stage = [&](int s, int buffer) {
    const int run = s / num_steps;
    const int k0 = k_begin + (s % num_steps) * kStepK;
    T* x_tile = stages + buffer * stage_elems;
    T* a_tile = x_tile + kTileRows * kLdK;
    constexpr int kVecsPerRow = kStepK / 8;
    const int begin = runs.begin[run], end = runs.end[run], rank = runs.rank[run];
    for (int i = threadIdx.x; i < (end - begin) * kVecsPerRow; i += kShrinkThreads) {
      const int row = begin + i / kVecsPerRow, col = (i % kVecsPerRow) * 8;
      const bool fill = k0 + col < k_end;
      const T* src = fill ? x + static_cast<size_t>(runs.tokens[row]) * hidden_in + k0 + col : x;
      cp_async_16(x_tile + row * kLdK + col, src, fill);
    }
    const T* lora_a = pool + runs.offset[run];
    for (int i = threadIdx.x; i < round_up_16(rank) * kVecsPerRow; i += kShrinkThreads) {
      const int r = i / kVecsPerRow, col = (i % kVecsPerRow) * 8;
      const bool fill = r < rank && k0 + col < k_end;
      const T* src = fill ? lora_a + static_cast<size_t>(r) * hidden_in + k0 + col : x;
      cp_async_16(a_tile + r * kLdK + col, src, fill);
    }
  };

  float acc[kMaxFragments][4];
#pragma unroll
  for (int f = 0; f < kMaxFragments; ++f) acc[f][0] = acc[f][1] = acc[f][2] = acc[f][3] = 0.f;

  // One commit group per stage (empty past the last), so waiting until kStages - 2 groups are pending always
  // means "stage s has landed" for this thread; the barrier after it makes every thread's copies visible and
  // tells that all threads are done with buffer (s - 1) % kStages, which is refilled right after.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < total_stages) load_stage(s, s);
    cp_async_commit();
  }
  for (int s = 0; s < total_stages; ++s) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (s + kStages - 1 < total_stages) load_stage(s + kStages - 1, (s + kStages - 1) % kStages);
    cp_async_commit();

    const int run = s / num_steps;
    const int begin = runs.begin[run], end = runs.end[run];
    const int num_pairs = round_up_16(runs.rank[run]) / 16;  // pairs of 8-wide fragments of the rank
    if (warp * 16 >= end || warp * 16 + 16 <= begin) continue;  // none of this warp's rows in the run
    const T* x_tile = stages + (s % kStages) * stage_elems;
    const T* a_tile = x_tile + kTileRows * kLdK;
#pragma unroll
    for (int kk = 0; kk < kStepK; kk += 16) {
      unsigned a[4];
      ldmatrix_x4(a, x_tile + (warp * 16 + lane % 16) * kLdK + kk + (lane / 16) * 8);
      mask_rows(a, warp * 16, begin, end);
#pragma unroll
      for (int pair = 0; pair < kMaxFragments / 2; ++pair) {
        if (pair < num_pairs) {
          // A rows are [r][k] row-major = the k x r operand column-major: plain ldmatrix gives its fragments.
          unsigned b[4];
          ldmatrix_x4(b, a_tile + (pair * 16 + lane % 8 + (lane / 16) * 8) * kLdK + kk + ((lane / 8) % 2) * 8);
          mma_16816<T>(acc[2 * pair], a, b[0], b[1]);
          mma_16816<T>(acc[2 * pair + 1], a, b[2], b[3]);
        }
      }
    }
  }

  // The whole tile, zero where nothing accumulated: the expand reads partials of every row without checks.
  const int group = lane / 4, pair_col = (lane % 4) * 2;
  float* out = v_partial + (static_cast<size_t>(split) * num_tokens_pad + tile_start + warp * 16 + group) * rank_pad;
#pragma unroll
  for (int f = 0; f < kMaxFragments; ++f) {
    if (f * 8 < rank_pad) {
      *reinterpret_cast<float2*>(out + f * 8 + pair_col) = make_float2(acc[f][0], acc[f][1]);
      *reinterpret_cast<float2*>(out + 8 * rank_pad + f * 8 + pair_col) = make_float2(acc[f][2], acc[f][3]);
    }
  }
}

// y[token(p), n] += sum_r v[p, r] * Bt_slot(p)[r, n] for the tile's positions p with an adapter, over
// `chunks_per_block` consecutive column chunks of kTileCols: the token ids, runs and v tile are found once per
// block, then the chunks stream through a pipeline: the y tile of chunk c + 1 (double buffer) and the Bt tiles
// of chunk c + 1 load while chunk c is multiplied, added and stored. Dynamic shared memory: y tiles
// [2][kTileRows][kLdOut], Bt tiles [2][rank_pad][kLdOut], v tile [kTileRows][rank_pad + 8] (all T).
template <typename T>
__global__ void __launch_bounds__(kExpandThreads, 2)
expand_tiled_kernel(T* __restrict__ y, const T* __restrict__ pool, const int64_t* __restrict__ b_offsets,
                    const int32_t* __restrict__ lora_ranks, const int32_t* __restrict__ sorted_token_ids,
                    const int32_t* __restrict__ sorted_slots, const float* __restrict__ v_partial,
                    int num_tokens, int num_tokens_pad, int hidden_out, int max_rank, int rank_pad, int num_slots,
                    int num_splits, int chunks_per_block) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ TileRuns runs;
  const int ld_v = rank_pad + 8;
  T* y_tiles = reinterpret_cast<T*>(smem_raw);
  T* bt_tiles = y_tiles + 2 * kTileRows * kLdOut;
  T* v_tile = bt_tiles + 2 * rank_pad * kLdOut;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int tile_start = blockIdx.x * kTileRows;
  const int first_col = blockIdx.y * chunks_per_block * kTileCols;
  const int num_chunks = min(chunks_per_block, (hidden_out - first_col + kTileCols - 1) / kTileCols);
  const int valid_rows = min(kTileRows, num_tokens - tile_start);
  constexpr int kVecsPerRow = kTileCols / 8;

  // y rows of chunk c into buffer `buffer` (zero past hidden_out): issued as soon as the token ids are known.
  auto load_y = [&](int c, int buffer) {
    const int col0 = first_col + c * kTileCols;
    T* tile = y_tiles + buffer * kTileRows * kLdOut;
    for (int i = threadIdx.x; i < valid_rows * kVecsPerRow; i += kExpandThreads) {
      const int row = i / kVecsPerRow, col = (i % kVecsPerRow) * 8;
      const bool fill = col0 + col < hidden_out;
      cp_async_16(tile + row * kLdOut + col,
                  fill ? y + static_cast<size_t>(runs.tokens[row]) * hidden_out + col0 + col : y, fill);
    }
  };
  // Run `run`'s Bt rows for chunk c (zero from its rank up to the next multiple of 16, and past hidden_out).
  auto load_bt = [&](int run, int c, int buffer) {
    const int col0 = first_col + c * kTileCols;
    const T* lora_bt = pool + runs.offset[run];
    const int rank = runs.rank[run];
    T* tile = bt_tiles + buffer * rank_pad * kLdOut;
    for (int i = threadIdx.x; i < round_up_16(rank) * kVecsPerRow; i += kExpandThreads) {
      const int r = i / kVecsPerRow, col = (i % kVecsPerRow) * 8;
      const bool fill = r < rank && col0 + col < hidden_out;
      cp_async_16(tile + r * kLdOut + col, fill ? lora_bt + static_cast<size_t>(r) * hidden_out + col0 + col : y,
                  fill);
    }
  };

  // Commit groups, oldest first: y(0), Bt(0), y(1); then per chunk c: Bt(c + 1), y(c + 2). So at the top of
  // chunk c, waiting until one group is pending leaves only y(c + 1) in flight.
  load_tile_tokens(sorted_token_ids, sorted_slots, num_tokens, num_slots, tile_start, runs);
  load_y(0, 0);
  cp_async_commit();
  find_runs(lora_ranks, b_offsets, max_rank, runs);
  for (int run = 0; run < min(2, runs.count); ++run) load_bt(run, 0, run);
  cp_async_commit();
  if (num_chunks > 1) load_y(1, 1);
  cp_async_commit();

  wait_for_primary_grid();  // the shrink's partials are complete from here on
  // v tile: sum of the splits, rounded to T; zero past each row's rank (and for rows left alone).
  for (int i = threadIdx.x; i < kTileRows * rank_pad / 4; i += kExpandThreads) {
    const int row = i / (rank_pad / 4), r = (i % (rank_pad / 4)) * 4;
    const int row_rank = runs.row_rank[row];
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < row_rank) {
      const float* partial = v_partial + static_cast<size_t>(tile_start + row) * rank_pad + r;
      for (int split0 = 0; split0 < num_splits; split0 += kSumBatch) {  // kSumBatch loads in flight at once
        float4 parts[kSumBatch];
#pragma unroll
        for (int b = 0; b < kSumBatch; ++b) {
          const size_t split = split0 + b;
          parts[b] = split < num_splits ? *reinterpret_cast<const float4*>(partial + split * num_tokens_pad * rank_pad)
                                        : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int b = 0; b < kSumBatch; ++b) {
          sum.x += parts[b].x; sum.y += parts[b].y; sum.z += parts[b].z; sum.w += parts[b].w;
        }
      }
    }
    T* dst = v_tile + row * ld_v + r;
    dst[0] = from_float<T>(r + 0 < row_rank ? sum.x : 0.f);
    dst[1] = from_float<T>(r + 1 < row_rank ? sum.y : 0.f);
    dst[2] = from_float<T>(r + 2 < row_rank ? sum.z : 0.f);
    dst[3] = from_float<T>(r + 3 < row_rank ? sum.w : 0.f);
  }

  const int first_row = (warp % 4) * 16;
  const int warp_col = (warp / 4) * kWarpCols;
  const int group = lane / 4, pair_col = (lane % 4) * 2;
  for (int c = 0; c < num_chunks; ++c) {
    cp_async_wait<1>();  // y(c) and the Bt tiles of runs 0 and 1 have landed for this thread
    __syncthreads();     // ... for every thread; the v tile is complete
    float acc[kWarpCols / 8][4];
#pragma unroll
    for (int f = 0; f < kWarpCols / 8; ++f) acc[f][0] = acc[f][1] = acc[f][2] = acc[f][3] = 0.f;
    for (int run = 0; run < runs.count; ++run) {
      if (run >= 2) {  // tiles straddling three or more runs: this run's Bt was loaded after run - 2's pass
        cp_async_wait<0>();
        __syncthreads();
      }
      const int begin = runs.begin[run], end = runs.end[run];
      if (first_row < end && first_row + 16 > begin) {
        const T* bt_tile = bt_tiles + (run % 2) * rank_pad * kLdOut;
        for (int kk = 0; kk < round_up_16(runs.rank[run]); kk += 16) {
          unsigned a[4];
          ldmatrix_x4(a, v_tile + (first_row + lane % 16) * ld_v + kk + (lane / 16) * 8);
          mask_rows(a, first_row, begin, end);
#pragma unroll
          for (int pair = 0; pair < kWarpCols / 16; ++pair) {
            // Bt is [r][n] row-major: the transposing ldmatrix gives the r x n operand's column-major fragments.
            unsigned b[4];
            ldmatrix_x4_trans(b, bt_tile + (kk + lane % 8 + ((lane / 8) % 2) * 8) * kLdOut + warp_col + pair * 16 +
                                     (lane / 16) * 8);
            mma_16816<T>(acc[2 * pair], a, b[0], b[1]);
            mma_16816<T>(acc[2 * pair + 1], a, b[2], b[3]);
          }
        }
      }
      if (run + 2 < runs.count) {
        __syncthreads();  // everyone is done with this Bt buffer
        load_bt(run + 2, c, run % 2);
        cp_async_commit();
      }
    }
    __syncthreads();  // all passes of chunk c are done with the Bt buffers
    if (c + 1 < num_chunks)
      for (int run = 0; run < min(2, runs.count); ++run) load_bt(run, c + 1, run);
    cp_async_commit();

    // y tile += acc in shared memory (rows of the runs only), then 16-byte stores of those rows.
    T* y_tile = y_tiles + (c % 2) * kTileRows * kLdOut;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = first_row + group + half * 8;
      if (runs.row_rank[row] == 0) continue;
#pragma unroll
      for (int f = 0; f < kWarpCols / 8; ++f) {
        T* pair = y_tile + row * kLdOut + warp_col + f * 8 + pair_col;
        pair[0] = from_float<T>(to_float(pair[0]) + acc[f][2 * half]);
        pair[1] = from_float<T>(to_float(pair[1]) + acc[f][2 * half + 1]);
      }
    }
    __syncthreads();
    const int col0 = first_col + c * kTileCols;
    for (int i = threadIdx.x; i < kTileRows * kVecsPerRow; i += kExpandThreads) {
      const int row = i / kVecsPerRow, col = (i % kVecsPerRow) * 8;
      if (runs.row_rank[row] > 0 && col0 + col < hidden_out)
        *reinterpret_cast<uint4*>(y + static_cast<size_t>(runs.tokens[row]) * hidden_out + col0 + col) =
            *reinterpret_cast<const uint4*>(y_tile + row * kLdOut + col);
    }
    __syncthreads();  // the stores have read the y buffer: refill it with chunk c + 2
    if (c + 2 < num_chunks) load_y(c + 2, c % 2);
    cp_async_commit();
  }
}

struct TiledShape {
  int num_tiles, num_tokens_pad, rank_pad, k_chunk, num_splits;
};

// Shared memory of the shrink's pipeline (fp16 and bf16 alike).
size_t shrink_smem_bytes(int rank_pad) { return static_cast<size_t>(kStages) * (kTileRows + rank_pad) * kLdK * 2; }

TiledShape tiled_shape(const PunicaLoraProblem& p) {
  TiledShape s;
  s.num_tiles = (p.num_tokens + kTileRows - 1) / kTileRows;
  s.num_tokens_pad = s.num_tiles * kTileRows;
  s.rank_pad = round_up_16(p.max_rank);
  // Split K until the shrink has one wave of blocks: two per multiprocessor where their shared memory fits (rank
  // up to 32), else one; each streams x with kStages - 1 steps in flight. The expand sums the splits' partials.
  const int max_splits = (p.hidden_in + kStepK - 1) / kStepK;
  const int blocks_per_sm = shrink_smem_bytes(s.rank_pad) <= kSmemForTwoBlocks ? 2 : 1;
  int splits = blocks_per_sm * p.num_sms / s.num_tiles;
  splits = splits < 1 ? 1 : (splits > max_splits ? max_splits : splits);
  s.k_chunk = ((p.hidden_in + splits - 1) / splits + kStepK - 1) / kStepK * kStepK;
  s.num_splits = (p.hidden_in + s.k_chunk - 1) / s.k_chunk;
  return s;
}

template <typename T>
cudaError_t launch(const PunicaLoraProblem& p, float* v_partial, cudaStream_t stream) {
  const TiledShape s = tiled_shape(p);
  const size_t shrink_smem = shrink_smem_bytes(s.rank_pad);
  const size_t expand_smem =
      (2 * static_cast<size_t>(kTileRows + s.rank_pad) * kLdOut + static_cast<size_t>(kTileRows) * (s.rank_pad + 8)) *
      sizeof(T);
  static DynamicSmemLimit shrink_limit, expand_limit;
  cudaError_t err = shrink_limit.ensure(reinterpret_cast<const void*>(shrink_tiled_kernel<T>), p.device, shrink_smem);
  if (err != cudaSuccess) return err;
  err = expand_limit.ensure(reinterpret_cast<const void*>(expand_tiled_kernel<T>), p.device, expand_smem);
  if (err != cudaSuccess) return err;

  err = launch_kernel(shrink_tiled_kernel<T>, dim3(s.num_tiles, s.num_splits), dim3(kShrinkThreads), shrink_smem,
                      stream, LaunchOptions{}, static_cast<const T*>(p.x), static_cast<const T*>(p.pool), p.a_offsets,
                      p.lora_ranks, p.sorted_token_ids, p.sorted_slots, v_partial, p.num_tokens, s.num_tokens_pad,
                      p.hidden_in, p.max_rank, s.rank_pad, p.num_slots, s.k_chunk);
  if (err != cudaSuccess) return err;
  // Column chunks per expand block: as many as keep about one wave of blocks resident (two blocks per
  // multiprocessor fit when the shared memory allows), so each block pays its lookups once and streams y.
  const int num_chunks = (p.hidden_out + kTileCols - 1) / kTileCols;
  const int blocks_per_sm = expand_smem <= kSmemForTwoBlocks ? 2 : 1;
  const int resident = blocks_per_sm * p.num_sms;
  int chunks_per_block = (s.num_tiles * num_chunks + resident - 1) / resident;
  chunks_per_block = chunks_per_block > num_chunks ? num_chunks : chunks_per_block;
  const int col_blocks = (num_chunks + chunks_per_block - 1) / chunks_per_block;
  return launch_kernel(expand_tiled_kernel<T>, dim3(s.num_tiles, col_blocks), dim3(kExpandThreads), expand_smem,
                       stream, LaunchOptions{p.programmatic_launch != 0}, static_cast<T*>(p.y),
                       static_cast<const T*>(p.pool),
                       p.b_offsets, p.lora_ranks, p.sorted_token_ids, p.sorted_slots,
                       static_cast<const float*>(v_partial), p.num_tokens, s.num_tokens_pad, p.hidden_out,
                       p.max_rank, s.rank_pad, p.num_slots, s.num_splits, chunks_per_block);
}

}  // namespace
}  // namespace punica

size_t punica_tiled_workspace_floats(const PunicaLoraProblem& p) {
  const punica::TiledShape s = punica::tiled_shape(p);
  return static_cast<size_t>(s.num_splits) * s.num_tokens_pad * s.rank_pad;
}

cudaError_t punica_tiled_launch(const PunicaLoraProblem& p, float* workspace, cudaStream_t stream) {
  switch (p.dtype) {
    case PUNICA_FLOAT16: return punica::launch<__half>(p, workspace, stream);
    case PUNICA_BFLOAT16: return punica::launch<__nv_bfloat16>(p, workspace, stream);
    case PUNICA_FLOAT32: break;  // no fp32 tensor-core path: the dispatcher sends fp32 to the per-token path
  }
  return cudaErrorInvalidValue;
}
