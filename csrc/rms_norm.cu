// RMSNorm of each row in one launch (punica_norm.h). transformers' eager RMSNorm is eight elementwise and reduction
// kernels per call (widen, square, mean, add eps, rsqrt, scale, narrow, weight): at decode sizes each is a launch
// of a few microseconds over a few kilobytes, twice per decoder layer.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernel_common.cuh"
#include "punica_norm.h"

namespace punica {
namespace {

constexpr int kNormThreads = 256;  // 8 warps: a 4096-wide bf16 row is two 16-byte vectors per thread

// The sum of `value` over the block, in every thread. `scratch` holds a float per warp.
__device__ __forceinline__ float block_sum(float value, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(kFullMask, value, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  value = lane < blockDim.x / 32 ? scratch[lane] : 0.0f;
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(kFullMask, value, offset);
  return value;
}

// One block per row. With `vectors` (rows a whole number of 16-byte vectors, every array 16-byte aligned) each
// thread loads and stores 16 bytes at a time (the second pass re-reads the row from L1/L2); else element by element.
template <typename T>
__global__ void __launch_bounds__(kNormThreads) rms_norm_kernel(T* __restrict__ out, const T* __restrict__ x,
                                                                 const T* __restrict__ weight, int hidden, float eps,
                                                                 bool vectors) {
  __shared__ float scratch[kNormThreads / 32];
  const int64_t row = blockIdx.x;
  const T* x_row = x + row * hidden;
  T* out_row = out + row * hidden;
  constexpr int kVec = Vec<T>::kSize;
  float squares = 0.0f;
  if (vectors) {
    for (int i = threadIdx.x * kVec; i < hidden; i += blockDim.x * kVec) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x_row + i);
      const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float v = to_float(values[k]);
        squares = __fadd_rn(squares, __fmul_rn(v, v));  // rounded apart, as PyTorch's pow then sum
      }
    }
  } else {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      const float v = to_float(x_row[i]);
      squares = __fadd_rn(squares, __fmul_rn(v, v));
    }
  }
  // PyTorch's mean multiplies the sum by the float 1 / H, then another kernel adds eps: two roundings, not an FMA
  const float mean = __fmul_rn(block_sum(squares, scratch), 1.0f / static_cast<float>(hidden));
  const float inverse = rsqrtf(__fadd_rn(mean, eps));
  if (vectors) {
    for (int i = threadIdx.x * kVec; i < hidden; i += blockDim.x * kVec) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x_row + i);
      const uint4 raw_weight = *reinterpret_cast<const uint4*>(weight + i);
      const T* values = reinterpret_cast<const T*>(&raw);
      const T* weights = reinterpret_cast<const T*>(&raw_weight);
      uint4 packed;
      T* result = reinterpret_cast<T*>(&packed);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const T normalized = from_float<T>(to_float(values[k]) * inverse);
        result[k] = from_float<T>(to_float(weights[k]) * to_float(normalized));
      }
      *reinterpret_cast<uint4*>(out_row + i) = packed;
    }
  } else {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      const T normalized = from_float<T>(to_float(x_row[i]) * inverse);
      out_row[i] = from_float<T>(to_float(weight[i]) * to_float(normalized));
    }
  }
}

template <typename T>
cudaError_t launch(const PunicaRmsNormProblem& problem, cudaStream_t stream) {
  if (problem.num_rows == 0) return cudaSuccess;
  const auto aligned = [](const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; };
  const bool vectors = problem.hidden % Vec<T>::kSize == 0 && aligned(problem.out) && aligned(problem.x) &&
                       aligned(problem.weight);
  // A narrow row leaves most of 256 threads idle: fewer warps, at least one
  const int pieces = (problem.hidden + Vec<T>::kSize - 1) / Vec<T>::kSize;  // a thread's share in the vector pass
  const int threads = pieces >= kNormThreads ? kNormThreads : ((pieces + 31) / 32) * 32;
  rms_norm_kernel<T><<<static_cast<unsigned>(problem.num_rows), threads, 0, stream>>>(
      static_cast<T*>(problem.out), static_cast<const T*>(problem.x), static_cast<const T*>(problem.weight),
      problem.hidden, problem.eps, vectors);
  return cudaGetLastError();
}

}  // namespace
}  // namespace punica

extern "C" cudaError_t punica_rms_norm(const PunicaRmsNormProblem* problem, cudaStream_t stream) {
  switch (problem->dtype) {
    case PUNICA_FLOAT32: return punica::launch<float>(*problem, stream);
    case PUNICA_FLOAT16: return punica::launch<__half>(*problem, stream);
    case PUNICA_BFLOAT16: return punica::launch<__nv_bfloat16>(*problem, stream);
  }
  return cudaErrorInvalidValue;
}
