// Chunks of sorted positions, shared by the per-token kernels (two-launch and fused): a chunk is up to kChunk
// consecutive positions of sorted_token_ids that share one slot; it starts where the slot changes and at every
// multiple of kChunk. A block (or cluster) at the chunk's first position serves all its tokens and loads the
// adapter's factors once for them; blocks at other positions exit after the lookup. A grid walking a list of chunk
// starts visits the first positions only: punica_hf/ops/segments.py (_chunk_starts) repeats this rule to build the
// list, so a change here must change it there.
#pragma once

#include "kernel_common.cuh"

namespace punica {

constexpr int kChunk = 4;  // most tokens one block or cluster serves
static_assert(kChunk + 1 < 32, "the chunk lookup uses one lane per position, plus the previous one");

// K elements of one slice: 32 lanes x 16 bytes.
template <typename T>
__host__ __device__ constexpr int slice_elems() { return 32 * Vec<T>::kSize; }

// Where the outputs of a call live in y: output g is columns [begin[g], begin[g + 1]), rows begin[count] wide.
struct OutputColumns {
  int begin[PUNICA_MAX_OUTPUTS + 1];
  int count;
};

// Host side of a call's outputs: the kernel parameter, and the widest output's width in elements.
inline OutputColumns output_columns_of(const PunicaLoraProblem& p) {
  OutputColumns columns{};
  columns.count = p.num_outputs;
  for (int g = 0; g <= p.num_outputs; ++g) columns.begin[g] = p.output_columns[g];
  return columns;
}
inline int widest_output(const PunicaLoraProblem& p) {
  int widest = 0;
  for (int g = 0; g < p.num_outputs; ++g) {
    const int width = p.output_columns[g + 1] - p.output_columns[g];
    if (width > widest) widest = width;
  }
  return widest;
}

// The chunk a block at sorted position `position` serves; size 0 when the position does not start a chunk, has
// no adapter, or its slot's rank is 0 (nothing to do).
struct Chunk {
  int size;            // tokens of the chunk, 0..kChunk
  int rank;            // rank of its slot, 1..max_rank when size > 0
  int64_t a_offset;    // the slot's factor offsets in the pool (those asked for; 0 otherwise)
  int64_t b_offset;
  int tokens[kChunk];
  int position_token;  // the token at `position` itself
  bool position_served;  // whether that token has an adapter of rank > 0 (some chunk writes its update)
};

// All threads call it; warp 0 looks the chunk up (lane i: position - 1 + i), then a barrier publishes it. Two
// dependent loads: the positions' slots and token ids together, then the slot's rank and factor offsets (a null
// offsets table is not read).
__device__ __forceinline__ void find_chunk(const int32_t* sorted_token_ids, const int32_t* sorted_slots,
                                           const int32_t* lora_ranks, const int64_t* a_offsets,
                                           const int64_t* b_offsets, int num_tokens, int num_slots, int max_rank,
                                           int position, Chunk& chunk) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int q = position - 1 + lane;
    int slot = -2, token = 0;  // -2: outside the tokens, differs from every slot
    if (lane <= kChunk && q >= 0 && q < num_tokens) {
      slot = sorted_slots[q];
      if (lane >= 1) token = sorted_token_ids[q];
      if (slot < 0 || slot >= num_slots) slot = -1;
    }
    const int first_slot = __shfl_sync(kFullMask, slot, 1);
    const int previous_slot = __shfl_sync(kFullMask, slot, 0);
    const bool starts_chunk = position % kChunk == 0 || previous_slot != first_slot;
    // Lane i >= 1 holds position + i - 1; the chunk ends before the first lane whose slot differs or whose
    // position is the next multiple of kChunk. Lane kChunk + 1 always ends it (slot -2).
    const bool ends = lane >= 1 && (slot != first_slot || (lane >= 2 && (position + lane - 1) % kChunk == 0));
    const int size = __ffs(__ballot_sync(kFullMask, ends)) - 2;
    if (lane == 0) {
      int rank = 0;
      int64_t a_offset = 0, b_offset = 0;
      if (first_slot >= 0) {  // all loads in flight together; the offsets are used only if rank > 0
        rank = rank_of(lora_ranks, first_slot, max_rank);
        if (starts_chunk && a_offsets != nullptr) a_offset = a_offsets[first_slot];
        if (starts_chunk && b_offsets != nullptr) b_offset = b_offsets[first_slot];
      }
      chunk.size = starts_chunk && rank > 0 ? size : 0;
      chunk.rank = rank;
      chunk.a_offset = a_offset;
      chunk.b_offset = b_offset;
      chunk.position_served = rank > 0;
    }
    if (lane == 1) chunk.position_token = token;
    if (lane >= 1 && lane <= size) chunk.tokens[lane - 1] = token;
  }
  __syncthreads();
}

// Sums each of 8 values over the warp in 9 shuffles (not 8 x 5): halves the values at every step, so afterwards
// lane l holds the warp's sum of values[(l >> 2) & 7].
__device__ __forceinline__ float warp_sum_8(const float (&values)[8]) {
  const int lane = threadIdx.x % 32;
  float quad[4], pair[2];
  const bool upper16 = lane & 16, upper8 = lane & 8, upper4 = lane & 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // keep values i + 4 * upper16, send the other half to lane ^ 16
    const float keep = upper16 ? values[i + 4] : values[i];
    const float send = upper16 ? values[i] : values[i + 4];
    quad[i] = keep + __shfl_xor_sync(kFullMask, send, 16);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float keep = upper8 ? quad[i + 2] : quad[i];
    const float send = upper8 ? quad[i] : quad[i + 2];
    pair[i] = keep + __shfl_xor_sync(kFullMask, send, 8);
  }
  float sum = (upper4 ? pair[1] : pair[0]) + __shfl_xor_sync(kFullMask, upper4 ? pair[0] : pair[1], 4);
  sum += __shfl_xor_sync(kFullMask, sum, 2);
  sum += __shfl_xor_sync(kFullMask, sum, 1);
  return sum;
}

}  // namespace punica
