// Device helpers shared by the LoRA kernels: 16-byte vectors widened to float and back, cp.async, programmatic
// dependent launch, rank lookups; and the internal launchers of the two paths (per-token chunks, segment tiles).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>
#include <mutex>

#include "punica_lora.h"

namespace punica {

constexpr unsigned kFullMask = 0xffffffffu;  // every lane of a warp

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

// The Vec<T>::kSize elements packed in `raw`, widened to float. `raw` is taken by value: a reference bound to a
// global word lets nvcc split the 16-byte load into 2-byte ones (seen in kernel v2's SASS).
template <typename T>
__device__ __forceinline__ void widen(uint4 raw, float (&out)[Vec<T>::kSize]) {
  const T* elems = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec<T>::kSize; ++i) out[i] = to_float(elems[i]);
}

template <typename T>
__device__ __forceinline__ uint4 narrow(const float (&values)[Vec<T>::kSize]) {
  uint4 raw;
  T* elems = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec<T>::kSize; ++i) elems[i] = from_float<T>(values[i]);
  return raw;
}

// 16-byte global->shared copy that bypasses registers; fill=false writes 16 zero bytes and reads nothing
// (gmem_src must still be a valid address).
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool fill) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = fill ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Programmatic dependent launch (sm_90+; no-ops below, and when the grid was launched without the attribute).
// The shrink lets the expand grid start early; the expand waits for the whole shrink grid (its writes visible)
// before it reads the shrink's output, and may read anything else (inputs written before the shrink) earlier.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_primary_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Rank of `slot` in this layer, clamped to [0, max_rank] (the workspaces are sized by max_rank).
__device__ __forceinline__ int rank_of(const int32_t* lora_ranks, int slot, int max_rank) {
  return slot < 0 ? 0 : max(0, min(lora_ranks[slot], max_rank));
}

}  // namespace punica

// Path launchers (host). Each enqueues its shrink + expand kernels and returns cudaGetLastError().
size_t punica_per_token_workspace_floats(const PunicaLoraProblem& problem);
// positions: null (a block per position), or a chunk-start list to walk (punica_lora.h, short_run_chunk_starts).
cudaError_t punica_per_token_launch(const PunicaLoraProblem& problem, const int32_t* positions, float* workspace,
                                    cudaStream_t stream);
// Whether the fused one-launch per-token path takes `problem` (problem.fused set and its slices fit); no workspace.
bool punica_fused_fits(const PunicaLoraProblem& problem);
cudaError_t punica_fused_launch(const PunicaLoraProblem& problem, cudaStream_t stream);
size_t punica_tiled_workspace_floats(const PunicaLoraProblem& problem);
cudaError_t punica_tiled_launch(const PunicaLoraProblem& problem, float* workspace, cudaStream_t stream);
// Largest max_rank the tiled path takes; above it the per-token path runs.
constexpr int kTiledMaxRank = 128;

// The dynamic shared-memory limit of one kernel instantiation, raised per device by the first launch (and by any
// later one that needs more): cudaFuncSetAttribute, microseconds of host time, then runs once per (kernel, device)
// in steady state instead of at every launch. Set even for small sizes: static plus dynamic shared memory above
// 48 KB needs the opt-in (48 KB of dynamic memory plus a small static struct failed to launch without it). Use one
// function-local static instance per instantiation. The attribute belongs to the current device's context (the
// caller's device guard makes that `device`). A limit is never lowered, so concurrent callers are safe.
class DynamicSmemLimit {
 public:
  // large_clusters: also allow clusters above the portable 8 blocks (set with the limit, so once per device).
  cudaError_t ensure(const void* kernel, int device, size_t bytes, bool large_clusters = false) {
    if (device < 0 || device >= PUNICA_MAX_DEVICES) return set(kernel, bytes, large_clusters);  // not cached
    if (raised_[device].load(std::memory_order_acquire) >= bytes + 1) return cudaSuccess;
    const std::lock_guard<std::mutex> lock(mutex_);
    if (raised_[device].load(std::memory_order_relaxed) >= bytes + 1) return cudaSuccess;
    const cudaError_t err = set(kernel, bytes, large_clusters);
    if (err == cudaSuccess) raised_[device].store(bytes + 1, std::memory_order_release);
    return err;
  }

 private:
  static cudaError_t set(const void* kernel, size_t bytes, bool large_clusters) {
    if (large_clusters) {
      const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
      if (err != cudaSuccess) return err;
    }
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  }

  std::atomic<size_t> raised_[PUNICA_MAX_DEVICES] = {};  // per device: the limit set + 1, 0 = never set
  std::mutex mutex_;
};

// How a kernel is launched. programmatic: the grid may start while the previous kernel of the stream still runs
// (once that kernel calls allow_dependent_launch, or as its last blocks exit), and must wait_for_primary_grid
// before reading that kernel's output
// (captured in a CUDA graph as a programmatic edge). cluster: blocks per thread-block cluster along x (sm_90+;
// grid.x a multiple of it), 1 = no clusters.
struct LaunchOptions {
  bool programmatic = false;
  unsigned cluster = 1;
};

template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          LaunchOptions options, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  unsigned count = 0;
  if (options.programmatic) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (options.cluster > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count++].val.clusterDim = {options.cluster, 1, 1};
  }
  config.attrs = attributes;
  config.numAttrs = count;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}
