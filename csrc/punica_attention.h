// C interface of the paged attention kernel: plain C types, raw device pointers, a CUDA stream.
// Kept free of torch headers so paged_attention.cu compiles quickly; csrc/punica_ops.cpp binds it to torch.
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "punica_lora.h"  // PunicaDtype, PUNICA_MAX_DEVICES

#ifdef __cplusplus
extern "C" {
#endif

// Most splits of one row's keys (each split's partial results take (D + 2) floats per query row and head).
#define PUNICA_ATTENTION_MAX_SPLITS 64

// Attention of B packed sequences over a paged KV cache (transformers' continuous batching layout).
// Sequence b: query rows cu_seq_lens_q[b] .. cu_seq_lens_q[b + 1] (q_len of them) and keys
// key_slots[cu_seq_lens_k[b] .. cu_seq_lens_k[b + 1]] (k_len cache slots, in position order). Query i of the sequence
// (0-based) attends to keys 0 .. k_len - q_len + i; query head h reads kv head h / (Hq / Hkv).
// Padding (static shapes for CUDA graphs): rows at or beyond cu_seq_lens_q[B] belong to no sequence and come out zero
// (their queries are never read); key_slots past cu_seq_lens_k[B] are never read; rows whose causal range is empty
// (k_len < q_len) come out zero. The cu tables must be non-decreasing; values outside [0, Tq] / [0, Tk] are clamped
// and slot values are clamped to [0, N), so no input reads out of range (the result of such input is undefined).
// All lengths are read on the device: no host sync, the launch depends on the shapes only.
typedef struct {
  void* out;                      // [Tq, Hq, D], dtype, contiguous: written whole
  const void* query;              // [Tq, Hq, D], dtype, contiguous
  const void* key_cache;          // [N, Hkv, D], dtype: slot s at key_cache + s * key_slot_stride, [Hkv, D] dense
  const void* value_cache;        // [N, Hkv, D], dtype: slot s at value_cache + s * value_slot_stride
  const void* key_slots;          // [Tk], int32 or int64 (slot_index_bytes)
  const int32_t* cu_seq_lens_q;   // [B + 1]
  const int32_t* cu_seq_lens_k;   // [B + 1]
  int64_t key_slot_stride;        // elements between consecutive slots of key_cache, a multiple of 8
  int64_t value_slot_stride;      // same for value_cache
  int64_t num_cache_slots;        // N
  int num_query_rows;             // Tq
  int num_key_slots;              // Tk
  int num_seqs;                   // B
  int num_q_heads, num_kv_heads;  // Hq, Hkv; Hq a multiple of Hkv
  int head_dim;                   // D: 64, 128 or 256
  int slot_index_bytes;           // 4 (int32 key_slots) or 8 (int64)
  float scale;                    // softmax scale applied to q . k
  int num_splits;                 // 0: chosen from the shapes (see punica_paged_attention_splits); else forced
  int device;                     // the CUDA device of every array (the launcher caches per-device settings)
  int num_sms;                    // multiprocessors of the device: sizes the split count (static per device)
  PunicaDtype dtype;              // PUNICA_FLOAT16 or PUNICA_BFLOAT16
} PunicaAttentionProblem;

// Splits of each row's keys the launch uses for `problem` (1 .. PUNICA_ATTENTION_MAX_SPLITS), from shapes only.
int punica_paged_attention_splits(const PunicaAttentionProblem* problem);

// Floats of scratch memory punica_paged_attention needs (0 with one split): depends on shapes only.
size_t punica_paged_attention_workspace_floats(const PunicaAttentionProblem* problem);

// Enqueues the kernels on `stream` (one launch, two with more than one split); `workspace` holds
// punica_paged_attention_workspace_floats(problem) floats of any content. Returns the first CUDA error met while
// configuring or launching (no synchronisation).
cudaError_t punica_paged_attention(const PunicaAttentionProblem* problem, float* workspace, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
