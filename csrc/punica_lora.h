// C interface of the punica_hf LoRA kernels: plain C types, raw device pointers, a CUDA stream.
// Kept free of torch headers so the .cu files compile quickly; csrc/punica_ops.cpp binds it to torch.
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { PUNICA_FLOAT32 = 0, PUNICA_FLOAT16 = 1, PUNICA_BFLOAT16 = 2 } PunicaDtype;

// One call of y[t] += B[s] @ (A[s] @ x[t]) for every token t whose slot s >= 0.
// T = num_tokens, S = num_slots, R = max_rank, G = num_segments = min(T, S). All tensors contiguous.
typedef struct {
  void* y;                          // [T, hidden_out], dtype, updated in place
  const void* x;                    // [T, hidden_in], dtype
  const void* lora_a;               // [S, R, hidden_in], dtype
  const void* lora_b;               // [S, hidden_out, R], dtype (scaling folded in)
  const int32_t* lora_ranks;        // [S], rank of each slot in this layer (0 = skip the slot)
  const int32_t* token_slots;       // [T], slot of each token, -1 = no adapter
  const int32_t* sorted_token_ids;  // [T], token ids grouped by slot, no-adapter tokens last
  const int32_t* segment_starts;    // [G + 1], segment g = sorted_token_ids[starts[g]:starts[g+1]]
  const int32_t* segment_slots;     // [G], slot of each non-empty segment, then -1 padding
  int num_tokens, hidden_in, hidden_out, max_rank, num_slots, num_segments;
  int num_sms;                      // multiprocessors of the device: sizes the grids (static per device)
  PunicaDtype dtype;
} PunicaLoraProblem;

// Floats of scratch memory punica_lora_add needs for `problem` (depends on shapes and dtype only).
size_t punica_lora_workspace_floats(const PunicaLoraProblem* problem);

// Enqueues the kernels on `stream`; `workspace` holds punica_lora_workspace_floats(problem) floats.
// Returns the first CUDA error met while configuring or launching (no synchronisation).
cudaError_t punica_lora_add(const PunicaLoraProblem* problem, float* workspace, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
