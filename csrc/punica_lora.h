// C interface of the punica_hf LoRA kernels: plain C types, raw device pointers, a CUDA stream.
// Kept free of torch headers so the .cu files compile quickly; csrc/punica_ops.cpp binds it to torch.
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Devices whose static settings (multiprocessors, shared-memory limits) the launchers and the binding cache.
#define PUNICA_MAX_DEVICES 64
// Most outputs one grouped call computes (projections sharing their input: q/k/v, gate/up).
#define PUNICA_MAX_OUTPUTS 4

typedef enum { PUNICA_FLOAT32 = 0, PUNICA_FLOAT16 = 1, PUNICA_BFLOAT16 = 2 } PunicaDtype;

// One call of y[t] += Bt_s^T @ (A_s @ x[t]) for every token t whose slot s >= 0 has rank r = lora_ranks[s] > 0.
// The factors of slot s live in one flat pool, each exactly its own size (no padding to the largest rank):
//   A_s  = pool[a_offsets[s] .. + r * hidden_in]   viewed as [r, hidden_in]   (LoRA A)
//   Bt_s = pool[b_offsets[s] .. + r * hidden_out]  viewed as [r, hidden_out]  (LoRA B transposed, scaling folded in)
// Offsets are element offsets, multiples of 8 (16-byte aligned rows); offsets of rank-0 slots are never read.
// T = num_tokens, S = num_slots. Slots are read per sorted position, so a kernel finds a position's adapter
// with one load (no sorted id -> token slot chain). All arrays contiguous; pool, x and y 16-byte aligned.
// A grouped call (num_outputs = G > 1: projections that share x) computes G such updates in one launch of each
// kernel: output g has its own tables (row g of [G, S] tables) and writes columns
// [output_columns[g], output_columns[g + 1]) of y, whose rows are hidden_out = output_columns[G] wide.
typedef struct {
  void* y;                          // [T, hidden_out], dtype, updated in place
  const void* x;                    // [T, hidden_in], dtype
  const void* pool;                 // [P], dtype: every adapter's factors
  const int64_t* a_offsets;         // [G, S]
  const int64_t* b_offsets;         // [G, S]
  const int32_t* lora_ranks;        // [G, S], rank of each slot in this layer (0 = skip the slot), <= max_rank
  const int32_t* sorted_token_ids;  // [T], token ids grouped by slot in increasing slot order, no-adapter tokens last
  const int32_t* sorted_slots;      // [T], slot of each sorted position (of token sorted_token_ids[p]), -1 = none
  // Optional (null: the tiled path serves every position): sorted_slots split in two by the caller, for calls on
  // the tiled path. The tiled kernels serve long_run_slots (slots with many tokens), the per-token kernels
  // short_run_slots (the others), -1 elsewhere in each: a tiled block would make one pass per short run.
  const int32_t* long_run_slots;    // [T]
  const int32_t* short_run_slots;   // [T]
  // Optional with the split (null: the per-token kernels launch a block per position of the call): the positions
  // where chunks (chunks.cuh) of short_run_slots start, in increasing order, then num_tokens up to the end. The
  // per-token kernels then run a grid of two waves that walks this list: in a mixed step most positions are the
  // long runs' (prefill tokens), which start no chunk of the short runs.
  const int32_t* short_run_chunk_starts;  // [T]
  int num_tokens, hidden_in, hidden_out, max_rank, num_slots;
  int num_outputs;                                // G, 1..PUNICA_MAX_OUTPUTS; above 1 only on the per-token path
  int accumulate;  // 1: y += updates; 0 (per-token path only): y = updates, zero where a token has none
  int output_columns[PUNICA_MAX_OUTPUTS + 1];     // [G + 1], output_columns[0] = 0, output_columns[G] = hidden_out
  int device;               // the CUDA device of every array (the launchers cache per-device settings)
  int num_sms;              // multiprocessors of the device: sizes the grids (static per device)
  int programmatic_launch;  // 1: the expand kernel may start before the shrink ends (sm_90+), 0: plain launches
  int fused;                // 1: per-token calls whose slices fit shared memory run as one launch (sm_90+ clusters)
  PunicaDtype dtype;
} PunicaLoraProblem;

// Floats of scratch memory punica_lora_add needs for `problem` (depends on shapes and dtype only).
size_t punica_lora_workspace_floats(const PunicaLoraProblem* problem);

// Enqueues the kernels on `stream`; `workspace` holds punica_lora_workspace_floats(problem) floats (any content).
// Returns the first CUDA error met while configuring or launching (no synchronisation).
cudaError_t punica_lora_add(const PunicaLoraProblem* problem, float* workspace, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
