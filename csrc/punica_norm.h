// C interface of the RMSNorm kernel: plain C types, raw device pointers, a CUDA stream.
// Kept free of torch headers so rms_norm.cu compiles quickly; csrc/punica_ops.cpp binds it to torch.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "punica_lora.h"  // PunicaDtype

#ifdef __cplusplus
extern "C" {
#endif

// out[t] = weight * round(x[t] * rsqrt(mean(x[t]^2) + eps)) for each of the T rows of x [T, H], the arithmetic of
// transformers' Llama-family RMSNorm: x widened to float, the mean of squares and the scaling in float, the normalized
// row rounded to the dtype, then multiplied by weight in float and rounded again. Only the order in which a row's
// squares are summed differs from PyTorch's reduction. One block per row; x, weight and out contiguous, one dtype.
typedef struct {
  void* out;           // [T, H], dtype, written whole
  const void* x;       // [T, H], dtype
  const void* weight;  // [H], dtype
  int64_t num_rows;    // T
  int hidden;          // H
  float eps;
  PunicaDtype dtype;   // PUNICA_FLOAT32, PUNICA_FLOAT16 or PUNICA_BFLOAT16
} PunicaRmsNormProblem;

// Enqueues the kernel on `stream` (one launch; none for T == 0). Returns the CUDA error of the launch, if any.
cudaError_t punica_rms_norm(const PunicaRmsNormProblem* problem, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
