// Fused per-token path (sm_90+): shrink and expand in one launch. A thread-block cluster of Cluster blocks (8, or
// 16 where the slices of 8 would fill shared memory) serves one chunk (chunks.cuh) for one output: block i of the
// cluster dots K slice i of A with the chunk's x, the cluster sums its Cluster partial v through distributed
// shared memory, and block i then expands column slice i of Bt. Every byte a block needs (its A and Bt slices, the
// chunk's x slice, and y when adding) is requested by cp.async right after the chunk lookup, so a call costs one
// memory round trip plus its bytes, and the partials never leave the chip: half the launches of the two-kernel
// path, no workspace, no wait between grids. Where staging Bt would leave fewer blocks per multiprocessor than the
// registers allow (wide outputs: Llama-3-8B's gate/up, 78 KB per block, two blocks and 30 clusters resident, two
// waves), Bt is prefetched into L2 instead and read from there by the expand.
//   grid (T * Cluster, 1, G), clusters (Cluster, 1, 1): block (position p, part i, output g).
//   Dynamic shared memory: A [max_rank][K slice], Bt [max_rank][N slice] (staged only), x [kChunk][K slice],
//   y [kChunk][N slice] (adding only), then partials and v [kChunk][max_rank] fp32.
// Written y (accumulate = 0): a position whose token has no adapter (or rank 0 for this output) zeroes its own row
// slice; every other row is written by the cluster of its chunk, so no two blocks touch one element.
#include <cooperative_groups.h>

#include "chunks.cuh"

namespace punica {
namespace {

namespace cg = cooperative_groups;

// Blocks per cluster: K and N are cut into this many slices. Calls with a wide input (Llama-3-8B's down projection:
// A and x slices of 72 KB per block in clusters of 8, two blocks per multiprocessor whose loads all start and end
// together) take clusters of 16 (the largest sm_90 allows, non-portable): half the bytes per block, four blocks per
// multiprocessor at different phases of their round trips, which overlaps their memory latency (faster for the
// down projection alone and in a compiled decode step; wide outputs gained nothing in the step, so the choice looks
// at the K side only: measurements in benchmarks/README.md). It depends on hidden_in and max_rank alone: a projection's bits are the same alone and in a group.
constexpr int kCluster = 8;
constexpr int kWideCluster = 16;
constexpr size_t kWideKSmem = 48 * 1024;  // A and x slices above it in clusters of 8: clusters of 16
constexpr int kFusedThreads = 256;
constexpr int kFusedWarps = kFusedThreads / 32;
// Where the fused kernel runs: it beats the two launches at few tokens and when tokens share adapters, and loses at
// many distinct adapters (one memory round trip per block, nothing overlapping it) and when a block's slices take
// most of a multiprocessor's shared memory (one block per multiprocessor); bench_ops.py measures the crossover.
constexpr int kFusedMaxTokens = 64;
constexpr size_t kFusedMaxSmem = 100 * 1024;  // two blocks per multiprocessor
// Blocks per multiprocessor the registers are capped for (shared memory permitting): five in clusters of 8 (48
// registers, no spills; with four, 62 clusters were resident, so 64 distinct tokens or the gate/up group at 32 took a
// second wave), four in clusters of 16 (at 48 registers those spill, and their slices allow four anyway).
constexpr int fused_min_blocks(int cluster) { return cluster == kCluster ? 5 : 4; }
// Most shared memory per block with Bt staged: that many blocks per multiprocessor (228 KB), each with its 1 KB of
// driver reserve and the static chunk.
constexpr size_t staged_bt_max_smem(int cluster) { return 228 * 1024 / fused_min_blocks(cluster) - 1024 - 64; }
static_assert(kChunk == 4, "the shrink reduces 2 rows x kChunk tokens with one warp_sum_8");

// Elements of one of `parts` slices of `size`, rounded up to whole 16-byte vectors.
template <typename T>
__host__ __device__ int slice_of(int size, int parts) {
  constexpr int kVec = Vec<T>::kSize;
  return ((size + parts - 1) / parts + kVec - 1) / kVec * kVec;
}

template <typename T>
size_t fused_smem_bytes(int hidden_in, int widest_out, int max_rank, bool accumulate, int cluster, bool staged_bt) {
  const size_t k_slice = slice_of<T>(hidden_in, cluster), n_slice = slice_of<T>(widest_out, cluster);
  const size_t elements =
      max_rank * (k_slice + (staged_bt ? n_slice : 0)) + kChunk * (k_slice + (accumulate ? n_slice : 0));
  return elements * sizeof(T) + 2 * static_cast<size_t>(kChunk) * max_rank * sizeof(float);
}

template <typename T, int Cluster, bool kStagedBt>
__global__ void __launch_bounds__(kFusedThreads, fused_min_blocks(Cluster))
fused_chunk_kernel(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ pool,
                   const int64_t* __restrict__ a_offsets, const int64_t* __restrict__ b_offsets,
                   const int32_t* __restrict__ lora_ranks, const int32_t* __restrict__ sorted_token_ids,
                   const int32_t* __restrict__ sorted_slots, int num_tokens, int hidden_in,
                   const __grid_constant__ OutputColumns columns, int max_rank, int num_slots, bool accumulate) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // clusters need sm_90: the binding never sets `fused` below it
#else
  constexpr int kVec = Vec<T>::kSize;
  const cg::cluster_group cluster = cg::this_cluster();
  const int part = static_cast<int>(cluster.block_rank());
  const int position = blockIdx.x / Cluster;
  const int output = blockIdx.z;
  const int hidden_out = columns.begin[output + 1] - columns.begin[output];
  const size_t row_width = columns.begin[columns.count];
  y += columns.begin[output];
  a_offsets += static_cast<size_t>(output) * num_slots;
  b_offsets += static_cast<size_t>(output) * num_slots;
  lora_ranks += static_cast<size_t>(output) * num_slots;

  // This block's K elements [k0, k0 + k_vectors * kVec) and columns [n0, n0 + n_vectors * kVec) of its output.
  const int k_slice = slice_of<T>(hidden_in, Cluster), n_slice = slice_of<T>(hidden_out, Cluster);
  const int k0 = part * k_slice, n0 = part * n_slice;
  const int k_vectors = max(0, min(k_slice, hidden_in - k0)) / kVec;
  const int n_vectors = max(0, min(n_slice, hidden_out - n0)) / kVec;
  // Tiles are laid out with this output's slice widths: within the space sized by the widest output.
  const int k_stride = k_slice / kVec, n_stride = n_slice / kVec;

  __shared__ Chunk chunk;
  find_chunk(sorted_token_ids, sorted_slots, lora_ranks, a_offsets, b_offsets, num_tokens, num_slots, max_rank,
             position, chunk);
  const int size = chunk.size;
  if (size == 0) {  // every block of the cluster sees the same chunk, so all leave here together
    if (!accumulate && !chunk.position_served) {
      uint4* row = reinterpret_cast<uint4*>(y + chunk.position_token * row_width + n0);
      for (int v = threadIdx.x; v < n_vectors; v += kFusedThreads) row[v] = make_uint4(0, 0, 0, 0);
    }
    return;
  }
  const int rank = chunk.rank;
  const T* lora_a = pool + chunk.a_offset;
  const T* lora_bt = pool + chunk.b_offset;

  extern __shared__ uint4 smem_vectors[];
  uint4* a_tile = smem_vectors;                           // [max_rank][k_stride]
  uint4* b_tile = a_tile + max_rank * k_stride;           // [max_rank][n_stride], staged only
  uint4* x_tile = b_tile + (kStagedBt ? max_rank * n_stride : 0);  // [kChunk][k_stride]
  uint4* y_tile = x_tile + kChunk * k_stride;             // [kChunk][n_stride], adding only
  float* partials = reinterpret_cast<float*>(y_tile + (accumulate ? kChunk * n_stride : 0));  // [kChunk][max_rank]
  float* v_shared = partials + kChunk * max_rank;         // [kChunk][max_rank]

  // Two copy groups: what the shrink reads (A, x), then what only the expand reads (Bt, y).
  for (int e = threadIdx.x; e < rank * k_vectors; e += kFusedThreads) {
    const int r = e / k_vectors, v = e % k_vectors;
    cp_async_16(a_tile + r * k_stride + v, lora_a + static_cast<size_t>(r) * hidden_in + k0 + v * kVec, true);
  }
  for (int e = threadIdx.x; e < size * k_vectors; e += kFusedThreads) {
    const int j = e / k_vectors, v = e % k_vectors;
    cp_async_16(x_tile + j * k_stride + v, x + static_cast<size_t>(chunk.tokens[j]) * hidden_in + k0 + v * kVec,
                true);
  }
  cp_async_commit();
  if constexpr (kStagedBt) {
    for (int e = threadIdx.x; e < rank * n_vectors; e += kFusedThreads) {
      const int r = e / n_vectors, v = e % n_vectors;
      cp_async_16(b_tile + r * n_stride + v, lora_bt + static_cast<size_t>(r) * hidden_out + n0 + v * kVec, true);
    }
  } else if (n_vectors > 0) {  // one bulk L2 prefetch per rank row of the slice (16-byte aligned, whole vectors)
    for (int r = threadIdx.x; r < rank; r += kFusedThreads) {
      const T* row = lora_bt + static_cast<size_t>(r) * hidden_out + n0;
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(row), "r"(n_vectors * 16) : "memory");
    }
  }
  for (int e = threadIdx.x; accumulate && e < size * n_vectors; e += kFusedThreads) {
    const int j = e / n_vectors, v = e % n_vectors;
    cp_async_16(y_tile + j * n_stride + v, y + chunk.tokens[j] * row_width + n0 + v * kVec, true);
  }
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();

  // Shrink: warp w takes row pairs (r, r + 8), r = w + 16 m; lane l sums vectors l, l + 32, ... of the slice for
  // each (row, token), and one warp_sum_8 reduces the 2 x kChunk dots. Every (token < size, row < rank) entry
  // of `partials` is written, zero for a block past the end of K.
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int r0 = warp; r0 < rank; r0 += 2 * kFusedWarps) {
    float dots[2 * kChunk] = {};
    for (int v = lane; v < k_vectors; v += 32) {
      float a_values[2][kVec] = {};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (r0 + h * kFusedWarps < rank) widen<T>(a_tile[(r0 + h * kFusedWarps) * k_stride + v], a_values[h]);
      }
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        if (j >= size) break;  // uniform over the warp: a chunk of one token (distinct adapters) dots once
        float x_values[kVec];
        widen<T>(x_tile[j * k_stride + v], x_values);
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < kVec; ++e) dots[h * kChunk + j] = fmaf(a_values[h][e], x_values[e], dots[h * kChunk + j]);
      }
    }
    const float sum = warp_sum_8(dots);
    const int entry = (lane >> 2) & 7, row = r0 + entry / kChunk * kFusedWarps, j = entry % kChunk;
    if (lane % 4 == 0 && row < rank && j < size) partials[j * max_rank + row] = sum;
  }

  // v = the cluster's partials summed in block order (the same sum in every block of the cluster).
  cluster.sync();
  for (int e = threadIdx.x; e < size * rank; e += kFusedThreads) {
    const int j = e / rank, r = e % rank;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < Cluster; ++i) sum += cluster.map_shared_rank(partials, i)[j * max_rank + r];
    v_shared[j * max_rank + r] = sum;
  }
  cluster.barrier_arrive();  // this block is done reading the others' partials; they may leave once all are
  cp_async_wait<0>();
  __syncthreads();

  // Expand: thread items (token j, column vector v): sum over the rank of v[j, r] * Bt[r, v], y added when asked.
  // Bt from shared memory when staged, else from global memory (L2, prefetched above); the same sum either way.
  const uint4* bt_vectors = kStagedBt ? b_tile : reinterpret_cast<const uint4*>(lora_bt + n0);
  const int bt_stride = kStagedBt ? n_stride : hidden_out / kVec;
  for (int item = threadIdx.x; item < size * n_vectors; item += kFusedThreads) {
    const int j = item / n_vectors, v = item % n_vectors;
    const float* v_row = v_shared + j * max_rank;
    float acc[kVec] = {};
    if (accumulate) widen<T>(y_tile[j * n_stride + v], acc);
#pragma unroll 4
    for (int r = 0; r < rank; ++r) {
      float b_values[kVec];
      widen<T>(bt_vectors[r * bt_stride + v], b_values);
      const float coefficient = v_row[r];
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] = fmaf(b_values[e], coefficient, acc[e]);
    }
    *reinterpret_cast<uint4*>(y + chunk.tokens[j] * row_width + n0 + v * kVec) = narrow<T>(acc);
  }
  cluster.barrier_wait();  // no block leaves while another may still read its partials
#endif
}

// How `p` runs: blocks per cluster, whether Bt is staged in shared memory, and the dynamic shared memory of a block.
struct FusedShape {
  int cluster;
  bool staged_bt;
  size_t smem;
};

template <typename T>
FusedShape fused_shape(const PunicaLoraProblem& p) {
  const size_t k_side = static_cast<size_t>(p.max_rank + kChunk) * slice_of<T>(p.hidden_in, kCluster) * sizeof(T);
  const int cluster = k_side > kWideKSmem ? kWideCluster : kCluster;
  const auto bytes = [&](bool staged_bt) {
    return fused_smem_bytes<T>(p.hidden_in, widest_output(p), p.max_rank, p.accumulate != 0, cluster, staged_bt);
  };
  const bool staged_bt = bytes(true) <= staged_bt_max_smem(cluster);
  return {cluster, staged_bt, bytes(staged_bt)};
}

template <typename T, int Cluster, bool StagedBt>
cudaError_t launch_clusters(const PunicaLoraProblem& p, size_t smem, cudaStream_t stream) {
  static DynamicSmemLimit smem_limit;
  const auto kernel = fused_chunk_kernel<T, Cluster, StagedBt>;
  const cudaError_t err = smem_limit.ensure(reinterpret_cast<const void*>(kernel), p.device, smem, Cluster > 8);
  if (err != cudaSuccess) return err;
  // A plain launch, not a dependent one (PDL): in a graph of a compiled decode step, programmatic edges made the
  // graph launch cost more host time per LoRA node and the replay no shorter (benchmarks/KERNEL_NOTES.md).
  LaunchOptions options;
  options.cluster = Cluster;
  return launch_kernel(kernel, dim3(p.num_tokens * Cluster, 1, p.num_outputs), dim3(kFusedThreads), smem, stream,
                       options, static_cast<T*>(p.y), static_cast<const T*>(p.x), static_cast<const T*>(p.pool),
                       p.a_offsets, p.b_offsets, p.lora_ranks, p.sorted_token_ids, p.sorted_slots, p.num_tokens,
                       p.hidden_in, output_columns_of(p), p.max_rank, p.num_slots, p.accumulate != 0);
}

template <typename T>
cudaError_t launch(const PunicaLoraProblem& p, cudaStream_t stream) {
  const FusedShape shape = fused_shape<T>(p);
  if (shape.cluster == kCluster) {
    return shape.staged_bt ? launch_clusters<T, kCluster, true>(p, shape.smem, stream)
                           : launch_clusters<T, kCluster, false>(p, shape.smem, stream);
  }
  return shape.staged_bt ? launch_clusters<T, kWideCluster, true>(p, shape.smem, stream)
                         : launch_clusters<T, kWideCluster, false>(p, shape.smem, stream);
}

}  // namespace
}  // namespace punica

bool punica_fused_fits(const PunicaLoraProblem& p) {
  if (!p.fused || p.num_tokens > punica::kFusedMaxTokens) return false;
  // Measured with Bt staged and the slices of clusters of 8, whatever runs (so the path choice is that of the tests
  // and measurements): rank 64 (141 KB at 4096) stays on two launches. Fused, it would read Bt from L2 in 16
  // dependent rounds per thread: slower than two launches at 1, 16 and 64 distinct tokens (benchmarks/KERNEL_NOTES.md,
  // "Rank 64 on the fused kernel").
  const int widest = punica::widest_output(p);
  const auto bytes = p.dtype == PUNICA_FLOAT32 ? punica::fused_smem_bytes<float> : punica::fused_smem_bytes<__half>;
  return bytes(p.hidden_in, widest, p.max_rank, p.accumulate != 0, punica::kCluster, true) <= punica::kFusedMaxSmem;
}

cudaError_t punica_fused_launch(const PunicaLoraProblem& p, cudaStream_t stream) {
  switch (p.dtype) {
    case PUNICA_FLOAT32: return punica::launch<float>(p, stream);
    case PUNICA_FLOAT16: return punica::launch<__half>(p, stream);
    case PUNICA_BFLOAT16: return punica::launch<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}
