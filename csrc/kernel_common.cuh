// Device helpers shared by the LoRA kernels: 16-byte vector loads widened to float, cp.async, and the
// internal launchers of the two paths (per-token SIMT, segment-tiled tensor cores).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "punica_lora.h"

namespace punica {

__device__ __forceinline__ float to_float(float value) { return value; }
__device__ __forceinline__ float to_float(__half value) { return __half2float(value); }
__device__ __forceinline__ float to_float(__nv_bfloat16 value) { return __bfloat162float(value); }

template <typename T>
__device__ __forceinline__ T from_float(float value);
template <>
__device__ __forceinline__ float from_float<float>(float value) { return value; }
template <>
__device__ __forceinline__ __half from_float<__half>(float value) { return __float2half_rn(value); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float value) { return __float2bfloat16_rn(value); }

// Elements of T in one 16-byte access: every global load of activations and weights is this wide.
template <typename T>
struct Vec {
  static constexpr int kSize = 16 / sizeof(T);
};

// Loads Vec<T>::kSize elements (16-byte aligned) and widens them to float.
template <typename T>
__device__ __forceinline__ void load_vec(const T* ptr, float (&out)[Vec<T>::kSize]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(ptr);
  const T* elems = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec<T>::kSize; ++i) out[i] = to_float(elems[i]);
}

template <typename T>
__device__ __forceinline__ void store_vec(T* ptr, const float (&values)[Vec<T>::kSize]) {
  uint4 raw;
  T* elems = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec<T>::kSize; ++i) elems[i] = from_float<T>(values[i]);
  *reinterpret_cast<uint4*>(ptr) = raw;
}

// 16-byte global->shared copy that bypasses registers; fill=false writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool fill) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = fill ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// The segment holding sorted position `position`: the last g < num_segments with starts[g] <= position.
// When position is past every token with an adapter this lands on a padding segment (slot -1).
__device__ __forceinline__ int find_segment(const int32_t* segment_starts, int num_segments, int position) {
  int lo = 0, hi = num_segments;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (segment_starts[mid] <= position) lo = mid; else hi = mid;
  }
  return lo;
}

}  // namespace punica

// Path launchers (host). Each enqueues its shrink + expand kernels and returns cudaGetLastError().
size_t punica_per_token_workspace_floats(const PunicaLoraProblem& problem);
cudaError_t punica_per_token_launch(const PunicaLoraProblem& problem, float* workspace, cudaStream_t stream);
size_t punica_tiled_workspace_floats(const PunicaLoraProblem& problem);
cudaError_t punica_tiled_launch(const PunicaLoraProblem& problem, float* workspace, cudaStream_t stream);
// Largest max_rank the tiled path takes; above it the per-token path runs.
constexpr int kTiledMaxRank = 128;
