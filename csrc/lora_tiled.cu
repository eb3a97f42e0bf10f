// Segment-tiled path (prefill, large batches; fp16/bf16): a block takes 64 consecutive positions of
// sorted_token_ids, so tokens of one adapter share each weight tile it loads, and runs the products on tensor
// cores (WMMA). A tile that straddles segments makes one pass per segment; in each pass the rows of other
// segments are zero, so all passes accumulate into the same registers and no masking is needed at the end.
//   shrink: grid (tiles, K splits), 4 warps; bf16/fp16 MMA with fp32 accumulators over a 2-stage cp.async
//           pipeline of 64-wide K steps; writes fp32 partials v_partial[split, position, r].
//   sum:    (only with several K splits) v = sum of the partials, so the expand blocks along H_out do not each
//           re-read all partials (r = 64: 160 MB of L2 reads for a 4096-token prefill otherwise).
//   expand: grid (tiles, H_out / 128), 4 warps; v (fp32) and B staged in shared memory as fp32, tf32 MMA
//           (v keeps 10 mantissa bits instead of bf16's 7), then y rows += the 64x128 tile.
#include <mma.h>

#include "kernel_common.cuh"

namespace punica {
namespace {

using namespace nvcuda;

constexpr int kTileTokens = 64;              // positions of sorted_token_ids per block (16 per warp)
constexpr int kWarps = kTileTokens / 16;
constexpr int kThreads = kWarps * 32;
constexpr int kStepK = 64;                   // shrink: input elements per pipeline stage
constexpr int kLdStage = kStepK + 8;         // shrink smem row stride (elements): 16-byte rows, banks staggered
constexpr int kTileOut = 128;                // expand: output columns per block (8 fragments per warp)
constexpr int kLdOut = kTileOut + 4;         // expand epilogue smem row stride (floats)
constexpr int kMaxFragments = kTiledMaxRank / 16;

// Rows [row_begin, row_end) of the tile that belong to segment `seg`, and its slot and rank; false if the
// walk over the tile's segments is over (past the tile, or padding segments).
struct SegmentPass {
  int slot, rank, row_begin, row_end;
};
__device__ __forceinline__ bool next_pass(const int32_t* segment_starts, const int32_t* segment_slots,
                                          const int32_t* lora_ranks, int num_segments, int num_slots, int max_rank,
                                          int tile_start, int seg, SegmentPass& pass) {
  if (seg >= num_segments) return false;
  const int begin = segment_starts[seg];
  const int slot = segment_slots[seg];
  if (begin >= tile_start + kTileTokens || slot < 0) return false;
  pass.slot = slot;
  pass.rank = slot < num_slots ? min(lora_ranks[slot], max_rank) : 0;
  pass.row_begin = max(begin, tile_start) - tile_start;
  pass.row_end = min(segment_starts[seg + 1], tile_start + kTileTokens) - tile_start;
  return true;
}

// v_partial[split, p, r] (p < T rounded up to the tile, r < rank_pad) = sum over this split's K range of
// A[slot(p), r, k] * x[sorted_token_ids[p], k]; zero for rows without adapter and columns past the rank.
template <typename T>
__global__ void __launch_bounds__(kThreads)
shrink_tiled_kernel(const T* __restrict__ x, const T* __restrict__ lora_a, const int32_t* __restrict__ lora_ranks,
                    const int32_t* __restrict__ sorted_token_ids, const int32_t* __restrict__ segment_starts,
                    const int32_t* __restrict__ segment_slots, float* __restrict__ v_partial, int num_tokens,
                    int num_tokens_pad, int hidden_in, int max_rank, int rank_pad, int num_slots, int num_segments,
                    int k_chunk) {
  extern __shared__ __align__(128) unsigned char smem_raw[];  // WMMA wants 32-byte aligned tiles
  __shared__ int tile_token[kTileTokens];
  T* smem = reinterpret_cast<T*>(smem_raw);
  const int stage_elems = (kTileTokens + rank_pad) * kLdStage;  // x tile [64][kLdStage], then A tile [rank_pad][...]
  const int warp = threadIdx.x / 32;
  const int tile_start = blockIdx.x * kTileTokens;
  const int split = blockIdx.y;
  const int k_begin = split * k_chunk;
  const int k_end = min(hidden_in, k_begin + k_chunk);
  const int num_steps = (k_end - k_begin + kStepK - 1) / kStepK;
  const int num_fragments = rank_pad / 16;

  for (int i = threadIdx.x; i < kTileTokens; i += kThreads) {
    const int position = tile_start + i;
    tile_token[i] = position < num_tokens ? sorted_token_ids[position] : 0;
  }
  __syncthreads();

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kMaxFragments];
#pragma unroll
  for (int f = 0; f < kMaxFragments; ++f) wmma::fill_fragment(acc[f], 0.f);

  SegmentPass pass;
  for (int seg = find_segment(segment_starts, num_segments, tile_start);
       next_pass(segment_starts, segment_slots, lora_ranks, num_segments, num_slots, max_rank, tile_start, seg, pass);
       ++seg) {
    if (pass.rank == 0 || pass.row_end <= pass.row_begin) continue;
    const T* a_slot = lora_a + static_cast<size_t>(pass.slot) * max_rank * hidden_in;

    // Stage `step` into buffer `buf`: x rows of this segment and A rows below the rank; zeros elsewhere.
    auto load_stage = [&](int step, int buf) {
      T* x_tile = smem + buf * stage_elems;
      T* a_tile = x_tile + kTileTokens * kLdStage;
      const int k0 = k_begin + step * kStepK;
      constexpr int kVecsPerRow = kStepK / 8;
      for (int i = threadIdx.x; i < kTileTokens * kVecsPerRow; i += kThreads) {
        const int row = i / kVecsPerRow, k = k0 + (i % kVecsPerRow) * 8;
        const bool fill = row >= pass.row_begin && row < pass.row_end && k < k_end;
        const T* src = fill ? x + static_cast<size_t>(tile_token[row]) * hidden_in + k : x;
        cp_async_16(x_tile + row * kLdStage + (i % kVecsPerRow) * 8, src, fill);
      }
      for (int i = threadIdx.x; i < rank_pad * kVecsPerRow; i += kThreads) {
        const int row = i / kVecsPerRow, k = k0 + (i % kVecsPerRow) * 8;
        const bool fill = row < pass.rank && k < k_end;
        const T* src = fill ? a_slot + static_cast<size_t>(row) * hidden_in + k : a_slot;
        cp_async_16(a_tile + row * kLdStage + (i % kVecsPerRow) * 8, src, fill);
      }
    };

    load_stage(0, 0);
    cp_async_commit();
    for (int step = 0; step < num_steps; ++step) {
      if (step + 1 < num_steps) load_stage(step + 1, (step + 1) % 2);
      cp_async_commit();
      cp_async_wait<1>();  // stage `step` has landed; the next one stays in flight
      __syncthreads();
      const T* x_tile = smem + (step % 2) * stage_elems;
      const T* a_tile = x_tile + kTileTokens * kLdStage;
#pragma unroll
      for (int kk = 0; kk < kStepK; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> x_frag;
        wmma::load_matrix_sync(x_frag, x_tile + warp * 16 * kLdStage + kk, kLdStage);
#pragma unroll
        for (int f = 0; f < kMaxFragments; ++f) {
          if (f < num_fragments) {
            // A tile is [r][k] row-major = the k x r operand in column-major order.
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> a_frag;
            wmma::load_matrix_sync(a_frag, a_tile + f * 16 * kLdStage + kk, kLdStage);
            wmma::mma_sync(acc[f], x_frag, a_frag, acc[f]);
          }
        }
      }
      __syncthreads();  // everyone is done with this buffer before it is refilled
    }
  }

  float* v_out = v_partial + (static_cast<size_t>(split) * num_tokens_pad + tile_start + warp * 16) * rank_pad;
#pragma unroll
  for (int f = 0; f < kMaxFragments; ++f) {
    if (f < num_fragments) wmma::store_matrix_sync(v_out + f * 16, acc[f], rank_pad, wmma::mem_row_major);
  }
}

// v[i] = sum over splits of v_partial[split, i], 4 floats at a time (the count is a multiple of 16).
__global__ void sum_splits_kernel(const float4* __restrict__ v_partial, float4* __restrict__ v, int count4,
                                  int num_splits) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count4) return;
  float4 sum = v_partial[i];
  for (int split = 1; split < num_splits; ++split) {
    const float4 part = v_partial[static_cast<size_t>(split) * count4 + i];
    sum.x += part.x; sum.y += part.y; sum.z += part.z; sum.w += part.w;
  }
  v[i] = sum;
}

// y[sorted_token_ids[p], n] += sum_r v[p, r] * B[slot(p), n, r] for the tile's positions p with an adapter.
template <typename T>
__global__ void __launch_bounds__(kThreads)
expand_tiled_kernel(T* __restrict__ y, const T* __restrict__ lora_b, const int32_t* __restrict__ lora_ranks,
                    const int32_t* __restrict__ sorted_token_ids, const int32_t* __restrict__ segment_starts,
                    const int32_t* __restrict__ segment_slots, const float* __restrict__ v, int num_tokens,
                    int hidden_out, int max_rank, int rank_pad, int num_slots, int num_segments) {
  constexpr int kVec = Vec<T>::kSize;
  extern __shared__ __align__(128) float smem_f[];
  __shared__ int tile_token[kTileTokens];
  __shared__ bool row_active[kTileTokens];  // row belongs to a segment with rank > 0: its y row is updated
  const int ld = rank_pad + 4;              // floats; a multiple of 4 as tf32 WMMA loads need
  float* v_tile = smem_f;                   // [64][ld]
  float* b_tile = smem_f + kTileTokens * ld;  // [kTileOut][ld]
  float* out_tile = smem_f;                 // [64][kLdOut], reuses the region after the last pass
  const int warp = threadIdx.x / 32;
  const int tile_start = blockIdx.x * kTileTokens;
  const int n0 = blockIdx.y * kTileOut;
  const int out_rows = min(kTileOut, hidden_out - n0);  // a multiple of 8: hidden_out is

  for (int i = threadIdx.x; i < kTileTokens; i += kThreads) {
    const int position = tile_start + i;
    tile_token[i] = position < num_tokens ? sorted_token_ids[position] : 0;
    row_active[i] = false;
  }

  wmma::fragment<wmma::accumulator, 16, 16, 8, float> acc[kTileOut / 16];
#pragma unroll
  for (int f = 0; f < kTileOut / 16; ++f) wmma::fill_fragment(acc[f], 0.f);

  SegmentPass pass;
  for (int seg = find_segment(segment_starts, num_segments, tile_start);
       next_pass(segment_starts, segment_slots, lora_ranks, num_segments, num_slots, max_rank, tile_start, seg, pass);
       ++seg) {
    if (pass.rank == 0 || pass.row_end <= pass.row_begin) continue;
    __syncthreads();  // the previous pass is done reading the tiles
    // v rows of this segment, zero for other rows and past the rank.
    for (int i = threadIdx.x; i < kTileTokens * rank_pad; i += kThreads) {
      const int row = i / rank_pad, r = i % rank_pad;
      const bool in_pass = row >= pass.row_begin && row < pass.row_end && r < pass.rank;
      v_tile[row * ld + r] = in_pass ? v[static_cast<size_t>(tile_start + row) * rank_pad + r] : 0.f;
    }
    // B rows n0 .. n0+out_rows of this slot are one contiguous run of out_rows * max_rank elements, 16-byte
    // aligned (n0 and hidden_out are multiples of 8): vector loads, then scatter to [n][r], zero past the rank.
    const T* b_run = lora_b + (static_cast<size_t>(pass.slot) * hidden_out + n0) * max_rank;
    for (int i = threadIdx.x; i < out_rows * max_rank / kVec; i += kThreads) {
      float values[kVec];
      load_vec(b_run + i * kVec, values);
      int n = i * kVec / max_rank, r = i * kVec % max_rank;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        b_tile[n * ld + r] = r < pass.rank ? values[j] : 0.f;
        if (++r == max_rank) { r = 0; ++n; }
      }
    }
    // Zero what the run does not cover: columns max_rank .. rank_pad, rows past hidden_out (edge tiles only).
    if (out_rows < kTileOut || max_rank < rank_pad) {
      for (int i = threadIdx.x; i < kTileOut * rank_pad; i += kThreads) {
        const int n = i / rank_pad, r = i % rank_pad;
        if (n >= out_rows || r >= max_rank) b_tile[n * ld + r] = 0.f;
      }
    }
    for (int i = pass.row_begin + threadIdx.x; i < pass.row_end; i += kThreads) row_active[i] = true;
    __syncthreads();

    for (int kk = 0; kk < rank_pad; kk += 8) {
      wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> v_frag;
      wmma::load_matrix_sync(v_frag, v_tile + warp * 16 * ld + kk, ld);
#pragma unroll
      for (int e = 0; e < v_frag.num_elements; ++e) v_frag.x[e] = wmma::__float_to_tf32(v_frag.x[e]);
#pragma unroll
      for (int f = 0; f < kTileOut / 16; ++f) {
        // B tile is [n][r] row-major = the r x n operand in column-major order.
        wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major> b_frag;
        wmma::load_matrix_sync(b_frag, b_tile + f * 16 * ld + kk, ld);
#pragma unroll
        for (int e = 0; e < b_frag.num_elements; ++e) b_frag.x[e] = wmma::__float_to_tf32(b_frag.x[e]);
        wmma::mma_sync(acc[f], v_frag, b_frag, acc[f]);
      }
    }
  }

  __syncthreads();  // last pass done with v_tile / b_tile, row_active complete
#pragma unroll
  for (int f = 0; f < kTileOut / 16; ++f)
    wmma::store_matrix_sync(out_tile + warp * 16 * kLdOut + f * 16, acc[f], kLdOut, wmma::mem_row_major);
  __syncthreads();

  constexpr int kVecsPerRow = kTileOut / kVec;
  for (int i = threadIdx.x; i < kTileTokens * kVecsPerRow; i += kThreads) {
    const int row = i / kVecsPerRow, col = (i % kVecsPerRow) * kVec;
    if (!row_active[row] || col >= out_rows) continue;
    T* y_ptr = y + static_cast<size_t>(tile_token[row]) * hidden_out + n0 + col;
    float values[kVec];
    load_vec(y_ptr, values);
#pragma unroll
    for (int j = 0; j < kVec; ++j) values[j] += out_tile[row * kLdOut + col + j];
    store_vec(y_ptr, values);
  }
}

struct TiledShape {
  int num_tiles, num_tokens_pad, rank_pad, k_chunk, num_splits;
};

TiledShape tiled_shape(const PunicaLoraProblem& p) {
  TiledShape s;
  s.num_tiles = (p.num_tokens + kTileTokens - 1) / kTileTokens;
  s.num_tokens_pad = s.num_tiles * kTileTokens;
  s.rank_pad = (p.max_rank + 15) / 16 * 16;
  // Split K until the shrink has ~2 blocks per multiprocessor: enough loads in flight to stream x.
  const int max_splits = (p.hidden_in + kStepK - 1) / kStepK;
  int splits = (2 * p.num_sms + s.num_tiles - 1) / s.num_tiles;
  splits = splits < 1 ? 1 : (splits > max_splits ? max_splits : splits);
  s.k_chunk = ((p.hidden_in + splits - 1) / splits + kStepK - 1) / kStepK * kStepK;
  s.num_splits = (p.hidden_in + s.k_chunk - 1) / s.k_chunk;
  return s;
}

template <typename T>
cudaError_t launch(const PunicaLoraProblem& p, float* v_partial, cudaStream_t stream) {
  const TiledShape s = tiled_shape(p);
  const size_t shrink_smem = 2 * static_cast<size_t>(kTileTokens + s.rank_pad) * kLdStage * sizeof(T);
  const size_t tiles_floats = static_cast<size_t>(kTileTokens + kTileOut) * (s.rank_pad + 4);
  const size_t out_floats = static_cast<size_t>(kTileTokens) * kLdOut;
  const size_t expand_smem = (tiles_floats > out_floats ? tiles_floats : out_floats) * sizeof(float);
  cudaError_t err = cudaFuncSetAttribute(shrink_tiled_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(shrink_smem));
  if (err != cudaSuccess) return err;
  err = cudaFuncSetAttribute(expand_tiled_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(expand_smem));
  if (err != cudaSuccess) return err;

  shrink_tiled_kernel<T><<<dim3(s.num_tiles, s.num_splits), kThreads, shrink_smem, stream>>>(
      static_cast<const T*>(p.x), static_cast<const T*>(p.lora_a), p.lora_ranks, p.sorted_token_ids,
      p.segment_starts, p.segment_slots, v_partial, p.num_tokens, s.num_tokens_pad, p.hidden_in, p.max_rank,
      s.rank_pad, p.num_slots, p.num_segments, s.k_chunk);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const float* v = v_partial;
  if (s.num_splits > 1) {
    const int count4 = s.num_tokens_pad * s.rank_pad / 4;
    float* v_sum = v_partial + static_cast<size_t>(s.num_splits) * s.num_tokens_pad * s.rank_pad;
    sum_splits_kernel<<<(count4 + 255) / 256, 256, 0, stream>>>(reinterpret_cast<const float4*>(v_partial),
                                                                reinterpret_cast<float4*>(v_sum), count4, s.num_splits);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    v = v_sum;
  }
  const int out_blocks = (p.hidden_out + kTileOut - 1) / kTileOut;
  expand_tiled_kernel<T><<<dim3(s.num_tiles, out_blocks), kThreads, expand_smem, stream>>>(
      static_cast<T*>(p.y), static_cast<const T*>(p.lora_b), p.lora_ranks, p.sorted_token_ids, p.segment_starts,
      p.segment_slots, v, p.num_tokens, p.hidden_out, p.max_rank, s.rank_pad, p.num_slots, p.num_segments);
  return cudaGetLastError();
}

}  // namespace
}  // namespace punica

size_t punica_tiled_workspace_floats(const PunicaLoraProblem& p) {
  const punica::TiledShape s = punica::tiled_shape(p);
  const int v_buffers = s.num_splits > 1 ? s.num_splits + 1 : 1;  // the partials, then their sum
  return static_cast<size_t>(v_buffers) * s.num_tokens_pad * s.rank_pad;
}

cudaError_t punica_tiled_launch(const PunicaLoraProblem& p, float* workspace, cudaStream_t stream) {
  switch (p.dtype) {
    case PUNICA_FLOAT16: return punica::launch<__half>(p, workspace, stream);
    case PUNICA_BFLOAT16: return punica::launch<__nv_bfloat16>(p, workspace, stream);
    case PUNICA_FLOAT32: break;  // no fp32 tensor-core path: the dispatcher sends fp32 to the per-token path
  }
  return cudaErrorInvalidValue;
}
