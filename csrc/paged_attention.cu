// Paged attention over transformers' paged KV cache: decode and prefill rows of many sequences in one launch, on
// tensor cores (mma.sync m16n8k16, fp32 accumulation), no host sync, launch shape from static shapes only.
//
// Work split. A block takes one tile of query rows (rows_per_tile consecutive rows of the packed [Tq] axis), one kv
// head (heads_per_tile of its query heads: a head block) and one split of the keys. The tile's (row, head) pairs are
// the 8 columns of both mma, so every key a warp loads serves all of them: the kv head's query heads (GQA) and, in
// prefill, up to 8 / heads_per_tile rows of one sequence. A tile whose rows span several sequences (decode tiles of
// 2 rows, a prefill's last rows) makes one pass per sequence, the other sequences' columns masked; all passes
// accumulate into the same registers. A pass's keys are cut into num_splits equal ranges of 16-key steps (the block
// takes range `split`; lengths are read on the device, so an empty range is possible and leaves neutral state); the
// block's 4 warps take the range's steps in turn, each with its own online softmax (fp32, base 2), and merge through
// shared memory at the end. With one split the block writes the output; with more it writes fp32 partials (max, sum,
// unnormalised output) and merge_splits_kernel combines them.
//
// One 16-key step of a warp (lane = 4 g + t):
//   S[16 keys, 8 columns] = K . Q^T over D / 16 k-steps. The sum runs over d, so d may be visited in any order both
//     operands agree on: lane (g, t) loads 16 contiguous bytes of keys g and g + 8 at d = 32 j + 8 t (and of Q's
//     column g at the same d), whose four words are its A / B fragment words of k-steps 2j and 2j + 1.
//   Mask (causal limit per column, the pass's key count), online softmax on S's accumulator layout (lane: keys g and
//     g + 8 of columns 2t and 2t + 1), P rounded to the input dtype and transposed in registers (movmatrix) into the
//     B fragment of the second mma (keys 2t, 2t + 1, 2t + 8, 2t + 9 of column g).
//   O^T[D, 8 columns] += V^T . P^T over D / 16 m-tiles. The output rows may be permuted too, as long as the final
//     store undoes it: row g of m-tile i is d = g * D/8 + i, row g + 8 is d = g * D/8 + D/16 + i. So lane (g, t)
//     reads one contiguous run of D/8 elements of each of its four keys with 16-byte loads, and ends up holding one
//     contiguous run of the output of each of its two columns (2t, 2t + 1: the same columns as its S values, so the
//     softmax rescaling needs no data movement).
// Keys past the pass's end are clamped to its last key (finite values) and masked, so no load needs a predicate.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <atomic>

#include "punica_attention.h"

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kStepKeys = 16;  // keys per warp step: the m of K . Q^T, the k of V^T . P^T
constexpr int kColumns = 8;    // (query row, head) pairs of a tile: the n of both mma
// A split gets at least this many keys of the longest row the shapes allow (one step per warp).
constexpr int kMinKeysPerSplit = kWarps * kStepKeys;
constexpr int kMaxGridY = 65535;
constexpr float kLog2e = 1.4426950408889634f;

struct Params {
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const void* key_slots;
  const int32_t* cu_seq_lens_q;
  const int32_t* cu_seq_lens_k;
  float* partial_out;     // [splits, Tq, Hq, D]: unnormalised output of each split (num_splits > 1)
  float2* partial_stats;  // [splits, Tq, Hq]: (max score in base-2 units, sum of exponentials) of each split
  int64_t key_slot_stride, value_slot_stride;
  int num_cache_slots;
  int num_query_rows, num_key_slots, num_seqs, num_q_heads;
  int group_size;      // Hq / Hkv
  int heads_per_tile;  // query heads of one kv head in a tile: min(group_size, 8)
  int rows_per_tile;   // query rows of a tile: 8 / heads_per_tile
  int head_blocks;     // tiles across one group: ceil(group_size / heads_per_tile)
  int num_splits;
  int wide_slots;      // key_slots are int64 (else int32)
  float scale_log2;    // softmax scale * log2(e): scores in base-2 units for ex2
};

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx: exact 0 at -inf, 2 ulp elsewhere
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint4 load_16(const void* address) {  // read-only path: K/V are not written meanwhile
  return __ldg(reinterpret_cast<const uint4*>(address));
}

// The 8x8 matrix of 16-bit elements held in fragment layout (lane 4 g + t: row g, columns 2t, 2t + 1), transposed.
__device__ __forceinline__ uint32_t transpose_8x8(uint32_t fragment) {
  uint32_t transposed;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(transposed) : "r"(fragment));
  return transposed;
}

// Element `half` (0: low, 1: high) of two packed pairs, side by side: first's in the low half.
template <int kHalf>
__device__ __forceinline__ uint32_t pair_halves(uint32_t first, uint32_t second) {
  return __byte_perm(first, second, kHalf == 0 ? 0x5410 : 0x7632);
}

template <typename T>
struct TypeOps;

template <>
struct TypeOps<__nv_bfloat16> {
  // acc (16x8 fp32) += a (16x16, row-major) . b (16x8, column-major)
  static __device__ __forceinline__ void mma(float (&acc)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float low, float high) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
    uint32_t bits;
    memcpy(&bits, &pair, sizeof(bits));
    return bits;
  }
};

template <>
struct TypeOps<__half> {
  static __device__ __forceinline__ void mma(float (&acc)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float low, float high) {
    const __half2 pair = __floats2half2_rn(low, high);
    uint32_t bits;
    memcpy(&bits, &pair, sizeof(bits));
    return bits;
  }
};

__device__ __forceinline__ int clamp_int(int value, int low, int high) { return min(max(value, low), high); }

// Cache slot of key_slots[position], clamped into the cache (a bad slot value must not read out of bounds).
__device__ __forceinline__ int key_slot(const Params& p, int position) {
  const long long slot = p.wide_slots ? __ldg(static_cast<const long long*>(p.key_slots) + position)
                                      : static_cast<long long>(__ldg(static_cast<const int*>(p.key_slots) + position));
  return static_cast<int>(min(max(slot, 0LL), static_cast<long long>(p.num_cache_slots - 1)));
}

// The sequence b whose rows [cu_q[b], cu_q[b + 1]) hold `row` (for non-decreasing tables: the number of entries
// cu_q[1..B] at or before `row`), B when `row` is past every sequence. Every thread of the block calls it and gets
// the same answer: one round of loads per 128 sequences instead of a chain of dependent loads.
__device__ __forceinline__ int sequence_at(const int32_t* __restrict__ cu_q, int num_seqs, int row) {
  int count = 0;
  for (int first = 0; first < num_seqs; first += kThreads) {
    const int b = first + static_cast<int>(threadIdx.x);
    count += __syncthreads_count(b < num_seqs && __ldg(cu_q + b + 1) <= row);
  }
  return count;
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreads) paged_attention_kernel(const Params p) {
  using Ops = TypeOps<T>;
  constexpr int kQkLoads = kHeadDim / 32;  // 16-byte loads of a key row (or Q column) per lane: 2 k-steps each
  constexpr int kRun = kHeadDim / 8;       // elements of one V row, and of one output column, a lane holds
  constexpr int kRunLoads = kRun / 8;      // 16-byte loads of that run
  constexpr int kMTiles = kHeadDim / 16;   // m-tiles of O^T
  constexpr int kChunks = kHeadDim / 8;    // 16-byte chunks of an output row
  // D <= 128: V loads go out with the K loads (one round trip per step); D = 256: after S, so K's registers are free
  // again and the step fits the register file without spilling.
  constexpr bool kEarlyValues = kHeadDim <= 128;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head_dim 64, 128 or 256");

  __shared__ __align__(16) float merge_out[kWarps][kColumns][kHeadDim];
  __shared__ float merge_max[kWarps][kColumns];
  __shared__ float merge_sum[kWarps][kColumns];

  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const int g = lane / 4, t = lane % 4;
  int block_y = static_cast<int>(blockIdx.y);
  const int split = block_y % p.num_splits;
  block_y /= p.num_splits;
  const int head_block = block_y % p.head_blocks;
  const int kv_head = block_y / p.head_blocks;
  const int first_row = static_cast<int>(blockIdx.x) * p.rows_per_tile;
  const int tile_end = min(first_row + p.rows_per_tile, p.num_query_rows);
  const int num_rows = p.num_query_rows;
  // Rows of some sequence: [rows_begin, rows_end). The rest is padding: zero output, query never read.
  const int rows_begin = clamp_int(__ldg(p.cu_seq_lens_q), 0, num_rows);
  const int rows_end = clamp_int(__ldg(p.cu_seq_lens_q + p.num_seqs), rows_begin, num_rows);

  // Column c: row first_row + c / heads_per_tile, query head of the group head_block * heads_per_tile +
  // c % heads_per_tile; -1 where the column is unused (past the group, past Tq, or past the tile's pairs).
  auto column_row = [&](int c) { return first_row + c / p.heads_per_tile; };
  auto column_head = [&](int c) {
    const int in_group = head_block * p.heads_per_tile + c % p.heads_per_tile;
    const bool used = c < p.rows_per_tile * p.heads_per_tile && in_group < p.group_size && column_row(c) < num_rows;
    return used ? kv_head * p.group_size + in_group : -1;
  };

  // Q^T B fragments of column g (zeros for unused and padding columns), in S's d order.
  uint32_t q_frag[kQkLoads][4];
  {
    const int row = column_row(g), head = column_head(g);
    const bool live = head >= 0 && row >= rows_begin && row < rows_end;
    const T* q = static_cast<const T*>(p.query) + (static_cast<int64_t>(row) * p.num_q_heads + head) * kHeadDim + 8 * t;
#pragma unroll
    for (int j = 0; j < kQkLoads; ++j) {
      const uint4 words = live ? load_16(q + 32 * j) : make_uint4(0, 0, 0, 0);
      q_frag[j][0] = words.x;
      q_frag[j][1] = words.y;
      q_frag[j][2] = words.z;
      q_frag[j][3] = words.w;
    }
  }

  // Online softmax state of columns 2t and 2t + 1 (row_sum covers this lane's keys only until the end) and O^T.
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  float acc[kMTiles][4];
#pragma unroll
  for (int i = 0; i < kMTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  const T* key_base = static_cast<const T*>(p.key_cache) + static_cast<int64_t>(kv_head) * kHeadDim + 8 * t;
  const T* value_base = static_cast<const T*>(p.value_cache) + static_cast<int64_t>(kv_head) * kHeadDim + g * kRun;

  // One pass per sequence among the tile's rows (block-uniform control flow: sequence_at synchronises).
  int row = max(first_row, rows_begin);
  const int last_live_row = min(tile_end, rows_end);
  while (row < last_live_row) {
    const int seq = sequence_at(p.cu_seq_lens_q, p.num_seqs, row);
    if (seq >= p.num_seqs) break;
    const int q_start = clamp_int(__ldg(p.cu_seq_lens_q + seq), 0, num_rows);
    const int q_end = clamp_int(__ldg(p.cu_seq_lens_q + seq + 1), q_start, num_rows);
    if (row < q_start) {  // only for a decreasing table: skip to the sequence's rows
      row = q_start;
      continue;
    }
    if (row >= q_end) break;  // only for a decreasing table: stop rather than loop
    const int pass_end = min(q_end, tile_end);
    const int k_start = clamp_int(__ldg(p.cu_seq_lens_k + seq), 0, p.num_key_slots);
    const int k_end = clamp_int(__ldg(p.cu_seq_lens_k + seq + 1), k_start, p.num_key_slots);
    const int k_len = p.num_cache_slots > 0 ? k_end - k_start : 0;
    // Row r of the sequence sees keys 0 .. r + causal_offset (its own key last).
    const int causal_offset = k_len - (q_end - q_start) - q_start;
    int last_key[2];  // of columns 2t, 2t + 1 in this pass; -1 masks every key (column of another pass, or unused)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = 2 * t + j, r = column_row(c);
      last_key[j] = column_head(c) >= 0 && r >= row && r < pass_end ? r + causal_offset : -1;
    }
    const int key_count = clamp_int(pass_end + causal_offset, 0, k_len);  // keys of the pass's last row
    const int num_steps = (key_count + kStepKeys - 1) / kStepKeys;
    const int steps_per_split = (num_steps + p.num_splits - 1) / p.num_splits;
    const int step_begin = split * steps_per_split;
    const int step_end = min(num_steps, step_begin + steps_per_split);

    // Slots of this lane's keys of a step: g, g + 8 (K), 2t, 2t + 1, 2t + 8, 2t + 9 (V); the next step's are fetched
    // while the current step's K/V loads are in flight.
    auto fetch_slots = [&](int step, int (&slots)[6]) {
      const int key0 = step * kStepKeys, last = key_count - 1;
      const int offsets[6] = {g, g + 8, 2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};
#pragma unroll
      for (int i = 0; i < 6; ++i) slots[i] = key_slot(p, k_start + min(key0 + offsets[i], last));
    };
    int slots[6];
    if (step_begin + warp < step_end) fetch_slots(step_begin + warp, slots);

    for (int step = step_begin + warp; step < step_end; step += kWarps) {
      uint4 k_low[kQkLoads], k_high[kQkLoads];
      {
        const T* low = key_base + static_cast<int64_t>(slots[0]) * p.key_slot_stride;
        const T* high = key_base + static_cast<int64_t>(slots[1]) * p.key_slot_stride;
#pragma unroll
        for (int j = 0; j < kQkLoads; ++j) {
          k_low[j] = load_16(low + 32 * j);
          k_high[j] = load_16(high + 32 * j);
        }
      }
      uint32_t v[4][kRun / 2];  // the runs of keys 2t, 2t + 1, 2t + 8, 2t + 9 as packed pairs
      const int64_t value_offsets[4] = {
          static_cast<int64_t>(slots[2]) * p.value_slot_stride, static_cast<int64_t>(slots[3]) * p.value_slot_stride,
          static_cast<int64_t>(slots[4]) * p.value_slot_stride, static_cast<int64_t>(slots[5]) * p.value_slot_stride};
      auto load_values = [&] {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
#pragma unroll
          for (int c = 0; c < kRunLoads; ++c) {
            const uint4 words = load_16(value_base + value_offsets[k] + 8 * c);
            v[k][4 * c] = words.x;
            v[k][4 * c + 1] = words.y;
            v[k][4 * c + 2] = words.z;
            v[k][4 * c + 3] = words.w;
          }
        }
      };
      if constexpr (kEarlyValues) load_values();
      const int key0 = step * kStepKeys;
      if (step + kWarps < step_end) fetch_slots(step + kWarps, slots);

      // S = K . Q^T; s[0], s[1]: key g of columns 2t, 2t + 1; s[2], s[3]: key g + 8.
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < kQkLoads; ++j) {
        Ops::mma(s, k_low[j].x, k_high[j].x, k_low[j].y, k_high[j].y, q_frag[j][0], q_frag[j][1]);
        Ops::mma(s, k_low[j].z, k_high[j].z, k_low[j].w, k_high[j].w, q_frag[j][2], q_frag[j][3]);
      }
      if constexpr (!kEarlyValues) load_values();

      float prob[4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float low = key0 + g <= last_key[j] ? s[j] * p.scale_log2 : -INFINITY;
        const float high = key0 + g + 8 <= last_key[j] ? s[2 + j] * p.scale_log2 : -INFINITY;
        float step_max = fmaxf(low, high);  // over the column's 16 keys: the 8 lanes of equal t
        step_max = fmaxf(step_max, __shfl_xor_sync(0xffffffffu, step_max, 4));
        step_max = fmaxf(step_max, __shfl_xor_sync(0xffffffffu, step_max, 8));
        step_max = fmaxf(step_max, __shfl_xor_sync(0xffffffffu, step_max, 16));
        const float new_max = fmaxf(row_max[j], step_max);
        const float base = new_max == -INFINITY ? 0.f : new_max;  // no key yet: exponents stay -inf, not NaN
        const float rescale = fast_exp2(row_max[j] - base);
        row_max[j] = new_max;
        prob[j] = fast_exp2(low - base);
        prob[2 + j] = fast_exp2(high - base);
        row_sum[j] = row_sum[j] * rescale + prob[j] + prob[2 + j];
#pragma unroll
        for (int i = 0; i < kMTiles; ++i) {
          acc[i][j] *= rescale;
          acc[i][2 + j] *= rescale;
        }
      }
      // P^T B fragments (keys 2t, 2t + 1 and 2t + 8, 2t + 9 of column g), rounded to T as flash attention does.
      const uint32_t p_low = transpose_8x8(Ops::pack(prob[0], prob[1]));
      const uint32_t p_high = transpose_8x8(Ops::pack(prob[2], prob[3]));

      // O^T += V^T . P^T; m-tile i: rows g, g + 8 are elements i and kMTiles + i of the lane's runs.
#pragma unroll
      for (int i = 0; i < kMTiles; ++i) {
        constexpr int kHalfOffset = kMTiles;  // element kMTiles + i sits kMTiles / 2 words further
        const int low_word = i / 2, high_word = (kHalfOffset + i) / 2;
        uint32_t a0, a1, a2, a3;
        if (i % 2 == 0) {
          a0 = pair_halves<0>(v[0][low_word], v[1][low_word]);
          a1 = pair_halves<0>(v[0][high_word], v[1][high_word]);
          a2 = pair_halves<0>(v[2][low_word], v[3][low_word]);
          a3 = pair_halves<0>(v[2][high_word], v[3][high_word]);
        } else {
          a0 = pair_halves<1>(v[0][low_word], v[1][low_word]);
          a1 = pair_halves<1>(v[0][high_word], v[1][high_word]);
          a2 = pair_halves<1>(v[2][low_word], v[3][low_word]);
          a3 = pair_halves<1>(v[2][high_word], v[3][high_word]);
        }
        Ops::mma(acc[i], a0, a1, a2, a3, p_low, p_high);
      }
    }
    row = pass_end;
  }

  // Each column's sum over the 8 lanes holding its keys (the max is common to them already); warp states to shared
  // memory: column 2t + j's run of output (elements i < kMTiles from acc[i][j], the rest from acc[i][2 + j]).
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    row_sum[j] += __shfl_xor_sync(0xffffffffu, row_sum[j], 4);
    row_sum[j] += __shfl_xor_sync(0xffffffffu, row_sum[j], 8);
    row_sum[j] += __shfl_xor_sync(0xffffffffu, row_sum[j], 16);
    float* run = merge_out[warp][2 * t + j] + g * kRun;
#pragma unroll
    for (int e = 0; e < kRun; e += 4) {
      float4 four;
      four.x = e < kMTiles ? acc[e][j] : acc[e - kMTiles][2 + j];
      four.y = e + 1 < kMTiles ? acc[e + 1][j] : acc[e + 1 - kMTiles][2 + j];
      four.z = e + 2 < kMTiles ? acc[e + 2][j] : acc[e + 2 - kMTiles][2 + j];
      four.w = e + 3 < kMTiles ? acc[e + 3][j] : acc[e + 3 - kMTiles][2 + j];
      *reinterpret_cast<float4*>(run + e) = four;
    }
    if (g == 0) {
      merge_max[warp][2 * t + j] = row_max[j];
      merge_sum[warp][2 * t + j] = row_sum[j];
    }
  }
  __syncthreads();

  // Merge the warps: one 8-element chunk of one column per task. Every used column is written, with zeros (one
  // split) or neutral partials (max -inf, sum 0) where no key reached it.
  for (int task = static_cast<int>(threadIdx.x); task < kColumns * kChunks; task += kThreads) {
    const int c = task / kChunks, chunk = task % kChunks;
    const int head = column_head(c);
    if (head < 0) continue;
    float best = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) best = fmaxf(best, merge_max[w][c]);
    float total = 0.f, value[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (best != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float weight = fast_exp2(merge_max[w][c] - best);
        total += weight * merge_sum[w][c];
        const float4 first = *reinterpret_cast<const float4*>(&merge_out[w][c][chunk * 8]);
        const float4 second = *reinterpret_cast<const float4*>(&merge_out[w][c][chunk * 8 + 4]);
        value[0] += weight * first.x;
        value[1] += weight * first.y;
        value[2] += weight * first.z;
        value[3] += weight * first.w;
        value[4] += weight * second.x;
        value[5] += weight * second.y;
        value[6] += weight * second.z;
        value[7] += weight * second.w;
      }
    }
    const int64_t pair = static_cast<int64_t>(column_row(c)) * p.num_q_heads + head;
    if (p.num_splits == 1) {
      const float inverse = total > 0.f ? 1.f / total : 0.f;
      uint4 packed;
      packed.x = Ops::pack(value[0] * inverse, value[1] * inverse);
      packed.y = Ops::pack(value[2] * inverse, value[3] * inverse);
      packed.z = Ops::pack(value[4] * inverse, value[5] * inverse);
      packed.w = Ops::pack(value[6] * inverse, value[7] * inverse);
      *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + pair * kHeadDim + chunk * 8) = packed;
    } else {
      const int64_t index = static_cast<int64_t>(split) * num_rows * p.num_q_heads + pair;
      float4* dst = reinterpret_cast<float4*>(p.partial_out + index * kHeadDim + chunk * 8);
      dst[0] = make_float4(value[0], value[1], value[2], value[3]);
      dst[1] = make_float4(value[4], value[5], value[6], value[7]);
      if (chunk == 0) p.partial_stats[index] = make_float2(best, total);
    }
  }
}

// out[row, head] = sum over splits of exp2(max_s - max) * out_s / sum of exp2(max_s - max) * sum_s: one warp per
// (row, head), D / 32 consecutive elements per lane. Zeros where no split saw a key (padding rows, empty ranges).
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreads) merge_splits_kernel(const Params p) {
  using Ops = TypeOps<T>;
  constexpr int kPerLane = kHeadDim / 32;
  const int64_t pairs = static_cast<int64_t>(p.num_query_rows) * p.num_q_heads;
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (pair >= pairs) return;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  float best = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) best = fmaxf(best, p.partial_stats[s * pairs + pair].x);
  float total = 0.f, value[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) value[e] = 0.f;
  if (best != -INFINITY) {
    for (int s = 0; s < p.num_splits; ++s) {
      const float2 stats = p.partial_stats[s * pairs + pair];
      const float weight = fast_exp2(stats.x - best);
      total += weight * stats.y;
      const float* src = p.partial_out + (s * pairs + pair) * kHeadDim + lane * kPerLane;
#pragma unroll
      for (int e = 0; e < kPerLane; e += 2) {
        const float2 two = *reinterpret_cast<const float2*>(src + e);
        value[e] += weight * two.x;
        value[e + 1] += weight * two.y;
      }
    }
  }
  const float inverse = total > 0.f ? 1.f / total : 0.f;
  uint32_t packed[kPerLane / 2];
#pragma unroll
  for (int e = 0; e < kPerLane; e += 2) packed[e / 2] = Ops::pack(value[e] * inverse, value[e + 1] * inverse);
  T* dst = static_cast<T*>(p.out) + pair * kHeadDim + lane * kPerLane;
  if constexpr (kPerLane == 2) {
    *reinterpret_cast<uint32_t*>(dst) = packed[0];
  } else if constexpr (kPerLane == 4) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
  } else {
    *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

// Tile shape of a problem (host).
struct Geometry {
  int group_size, heads_per_tile, rows_per_tile, head_blocks;
  int64_t num_tiles;
};

Geometry geometry_of(const PunicaAttentionProblem& p) {
  Geometry geo;
  geo.group_size = p.num_q_heads / p.num_kv_heads;
  geo.heads_per_tile = std::min(geo.group_size, kColumns);
  geo.rows_per_tile = kColumns / geo.heads_per_tile;
  geo.head_blocks = (geo.group_size + geo.heads_per_tile - 1) / geo.heads_per_tile;
  geo.num_tiles = (static_cast<int64_t>(p.num_query_rows) + geo.rows_per_tile - 1) / geo.rows_per_tile;
  return geo;
}

// Resident blocks of the attention kernel per multiprocessor, read once per device (it sizes the split count).
template <typename T, int kHeadDim>
int blocks_per_sm(int device) {
  static std::atomic<int> cached[PUNICA_MAX_DEVICES] = {};  // 0 = not read yet
  const bool cacheable = device >= 0 && device < PUNICA_MAX_DEVICES;
  if (cacheable) {
    const int known = cached[device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, paged_attention_kernel<T, kHeadDim>, kThreads, 0) !=
          cudaSuccess ||
      blocks < 1) {
    (void)cudaGetLastError();  // a failed query must not surface as the next launch's error
    blocks = 1;
  } else if (cacheable) {
    cached[device].store(blocks, std::memory_order_relaxed);
  }
  return blocks;
}

template <typename T, int kHeadDim>
cudaError_t launch(const PunicaAttentionProblem& problem, int splits, float* workspace, cudaStream_t stream) {
  const Geometry geo = geometry_of(problem);
  Params p{};
  p.out = problem.out;
  p.query = problem.query;
  p.key_cache = problem.key_cache;
  p.value_cache = problem.value_cache;
  p.key_slots = problem.key_slots;
  p.cu_seq_lens_q = problem.cu_seq_lens_q;
  p.cu_seq_lens_k = problem.cu_seq_lens_k;
  const int64_t pairs = static_cast<int64_t>(problem.num_query_rows) * problem.num_q_heads;
  p.partial_out = splits > 1 ? workspace : nullptr;
  p.partial_stats = splits > 1 ? reinterpret_cast<float2*>(workspace + splits * pairs * kHeadDim) : nullptr;
  p.key_slot_stride = problem.key_slot_stride;
  p.value_slot_stride = problem.value_slot_stride;
  p.num_cache_slots = static_cast<int>(problem.num_cache_slots);
  p.num_query_rows = problem.num_query_rows;
  p.num_key_slots = problem.num_key_slots;
  p.num_seqs = problem.num_seqs;
  p.num_q_heads = problem.num_q_heads;
  p.group_size = geo.group_size;
  p.heads_per_tile = geo.heads_per_tile;
  p.rows_per_tile = geo.rows_per_tile;
  p.head_blocks = geo.head_blocks;
  p.num_splits = splits;
  p.wide_slots = problem.slot_index_bytes == 8 ? 1 : 0;
  p.scale_log2 = problem.scale * kLog2e;
  const dim3 grid(static_cast<unsigned>(geo.num_tiles),
                  static_cast<unsigned>(problem.num_kv_heads * geo.head_blocks * splits));
  paged_attention_kernel<T, kHeadDim><<<grid, kThreads, 0, stream>>>(p);
  if (splits > 1) {
    const int64_t merge_blocks = (pairs + kWarps - 1) / kWarps;
    merge_splits_kernel<T, kHeadDim><<<static_cast<unsigned>(merge_blocks), kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

// The instantiation of a problem's dtype and head size.
struct Entry {
  int (*blocks_per_sm)(int device);
  cudaError_t (*launch)(const PunicaAttentionProblem&, int, float*, cudaStream_t);
};

template <typename T, int kHeadDim>
Entry entry() {
  return {&blocks_per_sm<T, kHeadDim>, &launch<T, kHeadDim>};
}

template <typename T>
bool find_entry_of_type(int head_dim, Entry* found) {
  switch (head_dim) {
    case 64: *found = entry<T, 64>(); return true;
    case 128: *found = entry<T, 128>(); return true;
    case 256: *found = entry<T, 256>(); return true;
    default: return false;
  }
}

bool find_entry(const PunicaAttentionProblem& p, Entry* found) {
  if (p.num_kv_heads < 1 || p.num_q_heads < p.num_kv_heads || p.num_q_heads % p.num_kv_heads != 0) return false;
  if (p.dtype == PUNICA_BFLOAT16) return find_entry_of_type<__nv_bfloat16>(p.head_dim, found);
  if (p.dtype == PUNICA_FLOAT16) return find_entry_of_type<__half>(p.head_dim, found);
  return false;
}

// Splits from static shapes: enough blocks for about two waves of the device, each split at least
// kMinKeysPerSplit keys of the longest row the shapes allow (Tk keys), at most PUNICA_ATTENTION_MAX_SPLITS and
// within the grid's y limit. Decode batches of a few long rows split most; large prefills not at all.
int choose_splits(const PunicaAttentionProblem& p, const Entry& kernels) {
  const Geometry geo = geometry_of(p);
  const int64_t heads_axis = static_cast<int64_t>(p.num_kv_heads) * geo.head_blocks;
  int64_t splits;
  if (p.num_splits > 0) {
    splits = p.num_splits;
  } else {
    const int64_t blocks = std::max<int64_t>(1, geo.num_tiles * heads_axis);
    const int64_t target = 2 * static_cast<int64_t>(std::max(p.num_sms, 1)) * kernels.blocks_per_sm(p.device);
    splits = (target + blocks - 1) / blocks;
    splits = std::min<int64_t>(splits, (static_cast<int64_t>(p.num_key_slots) + kMinKeysPerSplit - 1) /
                                           kMinKeysPerSplit);
  }
  splits = std::min<int64_t>(splits, PUNICA_ATTENTION_MAX_SPLITS);
  splits = std::min<int64_t>(splits, kMaxGridY / std::max<int64_t>(heads_axis, 1));
  return static_cast<int>(std::max<int64_t>(splits, 1));
}

}  // namespace

extern "C" int punica_paged_attention_splits(const PunicaAttentionProblem* problem) {
  Entry kernels;
  if (problem->num_query_rows == 0 || !find_entry(*problem, &kernels)) return 1;
  return choose_splits(*problem, kernels);
}

extern "C" size_t punica_paged_attention_workspace_floats(const PunicaAttentionProblem* problem) {
  const int splits = punica_paged_attention_splits(problem);
  if (splits <= 1) return 0;
  const size_t pairs = static_cast<size_t>(problem->num_query_rows) * problem->num_q_heads;
  return static_cast<size_t>(splits) * pairs * (problem->head_dim + 2);  // outputs, then (max, sum) pairs
}

extern "C" cudaError_t punica_paged_attention(const PunicaAttentionProblem* problem, float* workspace,
                                              cudaStream_t stream) {
  const PunicaAttentionProblem& p = *problem;
  Entry kernels;
  if (!find_entry(p, &kernels)) return cudaErrorInvalidValue;
  if (p.num_query_rows == 0) return cudaSuccess;
  if (p.num_seqs < 0 || p.num_key_slots < 0 || p.num_cache_slots < 0) return cudaErrorInvalidValue;
  const int splits = choose_splits(p, kernels);
  if (splits > 1 && workspace == nullptr) return cudaErrorInvalidValue;
  const Geometry geo = geometry_of(p);
  if (geo.num_tiles > 0x7fffffff || static_cast<int64_t>(p.num_kv_heads) * geo.head_blocks * splits > kMaxGridY)
    return cudaErrorInvalidConfiguration;
  return kernels.launch(p, splits, workspace, stream);
}
