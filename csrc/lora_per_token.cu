// Per-token path (decode): every token reads its own adapter's A and B rows with 16-byte coalesced loads.
// Bound by bytes and latency, not arithmetic, so plain fp32 FMAs on CUDA cores. Two launches:
//   shrink: grid (T, K slices of 32 lanes x 16 bytes), 8 warps; each warp dots its x slice with up to 4 rows
//           of A at once and writes one fp32 partial per (slice, token, row): no atomics, no zeroing.
//   expand: grid (T, H_out / 256), 256 output elements per block; sums the partials into v (fp32, shared
//           memory), then y[t, n] += B[s, n, :rank] . v with a few lanes sharing each row of B (coalesced).
// Tokens sharing an adapter re-read it, from L2 after the first: cheap up to a few hundred tokens.
#include "kernel_common.cuh"

namespace punica {
namespace {

constexpr int kShrinkWarps = 8;
constexpr int kShrinkRowsPerPass = 4;  // rows of A one warp loads before reducing: loads in flight
constexpr int kExpandThreads = 256;
constexpr int kExpandBatch = 4;  // rows of B a lane group loads before reducing: loads in flight

template <typename T>
__host__ __device__ constexpr int slice_elems() { return 32 * Vec<T>::kSize; }  // input elements per (warp, K slice)

// v_partial: [num_slices, T, R] fp32; entry (slice, t, row) = A[s, row, slice] . x[t, slice], row < rank.
template <typename T>
__global__ void __launch_bounds__(kShrinkWarps * 32)
shrink_per_token_kernel(const T* __restrict__ x, const T* __restrict__ lora_a, const int32_t* __restrict__ lora_ranks,
                        const int32_t* __restrict__ token_slots, float* __restrict__ v_partial, int num_tokens,
                        int hidden_in, int max_rank, int num_slots) {
  constexpr int kVec = Vec<T>::kSize;
  const int token = blockIdx.x;
  const int slice = blockIdx.y;
  const int slot = token_slots[token];
  if (slot < 0 || slot >= num_slots) return;  // out-of-range slots are treated as "no adapter"
  const int rank = min(lora_ranks[slot], max_rank);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;

  const int k = slice * slice_elems<T>() + lane * kVec;
  const bool k_in_range = k < hidden_in;
  float x_vec[kVec];
  if (k_in_range) {
    load_vec(x + static_cast<size_t>(token) * hidden_in + k, x_vec);
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) x_vec[i] = 0.f;
  }
  const T* a_slot = lora_a + static_cast<size_t>(slot) * max_rank * hidden_in;
  float* v_out = v_partial + (static_cast<size_t>(slice) * num_tokens + token) * max_rank;

  // Warp w takes rows w, w + 8, w + 16, w + 24 in its first pass, then the next 32 rows, ...
  for (int first_row = warp; first_row < rank; first_row += kShrinkWarps * kShrinkRowsPerPass) {
    float a_vec[kShrinkRowsPerPass][kVec];
#pragma unroll
    for (int i = 0; i < kShrinkRowsPerPass; ++i) {
      const int row = first_row + i * kShrinkWarps;
      if (k_in_range && row < rank) {
        load_vec(a_slot + static_cast<size_t>(row) * hidden_in + k, a_vec[i]);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) a_vec[i][j] = 0.f;
      }
    }
    float dot[kShrinkRowsPerPass];
#pragma unroll
    for (int i = 0; i < kShrinkRowsPerPass; ++i) {
      dot[i] = 0.f;
#pragma unroll
      for (int j = 0; j < kVec; ++j) dot[i] = fmaf(a_vec[i][j], x_vec[j], dot[i]);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
#pragma unroll
      for (int i = 0; i < kShrinkRowsPerPass; ++i) dot[i] += __shfl_xor_sync(0xffffffffu, dot[i], offset);
    }
    if (lane == 0) {
#pragma unroll
      for (int i = 0; i < kShrinkRowsPerPass; ++i) {
        const int row = first_row + i * kShrinkWarps;
        if (row < rank) v_out[row] = dot[i];
      }
    }
  }
}

// y[t, n] += sum_{r < rank} B[s, n, r] * v[t, r], v[t, r] = sum over slices of v_partial.
// A group of lanes_per_row lanes shares each row of B, lane j reading its vectors j, j + lanes_per_row, ...:
// with lanes_per_row = the row's vector count, a warp reads 512 contiguous bytes per load instruction.
// The block covers kExpandThreads rows; each group takes lanes_per_row of them, kExpandBatch at a time.
template <typename T>
__global__ void __launch_bounds__(kExpandThreads)
expand_per_token_kernel(T* __restrict__ y, const T* __restrict__ lora_b, const int32_t* __restrict__ lora_ranks,
                        const int32_t* __restrict__ token_slots, const float* __restrict__ v_partial, int num_tokens,
                        int hidden_out, int max_rank, int num_slots, int num_slices, int lanes_per_row) {
  constexpr int kVec = Vec<T>::kSize;
  extern __shared__ float v_shared[];  // [max_rank]: v of this token, zero past its rank
  const int token = blockIdx.x;
  const int slot = token_slots[token];
  if (slot < 0 || slot >= num_slots) return;
  const int rank = min(lora_ranks[slot], max_rank);
  if (rank == 0) return;

  for (int r = threadIdx.x; r < max_rank; r += kExpandThreads) {
    float sum = 0.f;
    if (r < rank) {
      for (int slice = 0; slice < num_slices; ++slice)
        sum += v_partial[(static_cast<size_t>(slice) * num_tokens + token) * max_rank + r];
    }
    v_shared[r] = sum;
  }
  __syncthreads();

  const int num_groups = kExpandThreads / lanes_per_row;
  const int group = threadIdx.x / lanes_per_row;
  const int lane_in_group = threadIdx.x % lanes_per_row;
  const bool vector_rows = max_rank % kVec == 0;  // rows 16-byte aligned
  const T* b_slot = lora_b + static_cast<size_t>(slot) * hidden_out * max_rank;
  T* y_row = y + static_cast<size_t>(token) * hidden_out;
  for (int first = 0; first < lanes_per_row; first += kExpandBatch) {
    int n[kExpandBatch];
    float y_old[kExpandBatch], partial[kExpandBatch];
#pragma unroll
    for (int b = 0; b < kExpandBatch; ++b) {  // y first: its latency overlaps the B loads
      n[b] = first + b < lanes_per_row ? blockIdx.y * kExpandThreads + (first + b) * num_groups + group : hidden_out;
      y_old[b] = n[b] < hidden_out && lane_in_group == 0 ? to_float(y_row[n[b]]) : 0.f;
    }
#pragma unroll
    for (int b = 0; b < kExpandBatch; ++b) {
      partial[b] = 0.f;
      if (n[b] >= hidden_out) continue;
      const T* b_row = b_slot + static_cast<size_t>(n[b]) * max_rank;
      if (vector_rows) {
        for (int r0 = lane_in_group * kVec; r0 < rank; r0 += lanes_per_row * kVec) {
          float b_vec[kVec];
          load_vec(b_row + r0, b_vec);
#pragma unroll
          for (int j = 0; j < kVec; ++j) partial[b] = fmaf(r0 + j < rank ? b_vec[j] : 0.f, v_shared[r0 + j], partial[b]);
        }
      } else {
        for (int r = lane_in_group; r < rank; r += lanes_per_row)
          partial[b] = fmaf(to_float(b_row[r]), v_shared[r], partial[b]);
      }
    }
    for (int offset = lanes_per_row / 2; offset > 0; offset /= 2) {
#pragma unroll
      for (int b = 0; b < kExpandBatch; ++b) partial[b] += __shfl_xor_sync(0xffffffffu, partial[b], offset);
    }
    if (lane_in_group == 0) {
#pragma unroll
      for (int b = 0; b < kExpandBatch; ++b)
        if (n[b] < hidden_out) y_row[n[b]] = from_float<T>(y_old[b] + partial[b]);
    }
  }
}

// Lanes sharing a row of B: the largest power of two up to 32 that divides the row's 16-byte vector count
// (1 when rows are not 16-byte aligned). Any power of two is correct; dividing keeps every load coalesced.
int lanes_per_row_for(int max_rank, int vec) {
  if (max_rank % vec != 0) return 1;
  const int vectors = max_rank / vec;
  int lanes = 1;
  while (lanes < 32 && vectors % (2 * lanes) == 0) lanes *= 2;
  return lanes;
}

int num_slices_for(const PunicaLoraProblem& p, int slice) { return (p.hidden_in + slice - 1) / slice; }

template <typename T>
cudaError_t launch(const PunicaLoraProblem& p, float* v_partial, cudaStream_t stream) {
  const int num_slices = num_slices_for(p, slice_elems<T>());
  shrink_per_token_kernel<T><<<dim3(p.num_tokens, num_slices), kShrinkWarps * 32, 0, stream>>>(
      static_cast<const T*>(p.x), static_cast<const T*>(p.lora_a), p.lora_ranks, p.token_slots, v_partial,
      p.num_tokens, p.hidden_in, p.max_rank, p.num_slots);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const size_t smem = static_cast<size_t>(p.max_rank) * sizeof(float);
  if (smem > 48 * 1024) {
    err = cudaFuncSetAttribute(expand_per_token_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  const int out_blocks = (p.hidden_out + kExpandThreads - 1) / kExpandThreads;
  expand_per_token_kernel<T><<<dim3(p.num_tokens, out_blocks), kExpandThreads, smem, stream>>>(
      static_cast<T*>(p.y), static_cast<const T*>(p.lora_b), p.lora_ranks, p.token_slots, v_partial, p.num_tokens,
      p.hidden_out, p.max_rank, p.num_slots, num_slices, lanes_per_row_for(p.max_rank, Vec<T>::kSize));
  return cudaGetLastError();
}

int slice_elems_for(PunicaDtype dtype) {
  return dtype == PUNICA_FLOAT32 ? slice_elems<float>() : slice_elems<__half>();
}

}  // namespace
}  // namespace punica

size_t punica_per_token_workspace_floats(const PunicaLoraProblem& p) {
  const int num_slices = punica::num_slices_for(p, punica::slice_elems_for(p.dtype));
  return static_cast<size_t>(num_slices) * p.num_tokens * p.max_rank;
}

cudaError_t punica_per_token_launch(const PunicaLoraProblem& p, float* workspace, cudaStream_t stream) {
  switch (p.dtype) {
    case PUNICA_FLOAT32: return punica::launch<float>(p, workspace, stream);
    case PUNICA_FLOAT16: return punica::launch<__half>(p, workspace, stream);
    case PUNICA_BFLOAT16: return punica::launch<__nv_bfloat16>(p, workspace, stream);
  }
  return cudaErrorInvalidValue;
}
