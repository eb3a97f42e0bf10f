// Entry point of the C interface: picks the path from static shapes only (never from tensor values, so the
// choice needs no host-device sync and is fixed for a captured graph or a compiled function). Where the caller
// split the positions by run length, a tiled call runs both paths, each on its own positions.
#include "kernel_common.cuh"

namespace {

// Up to this many tokens (decode batches) the per-token path runs: latency-bound, and its chunks already share
// each adapter's factors among up to 16 tokens. Above it, the segment-tiled tensor-core path shares them among
// the 64 positions of a tile. punica_hf/ops/segments.py relies on it (PER_TOKEN_MAX_TOKENS).
constexpr int kPerTokenMaxTokens = 256;

bool use_tiled(const PunicaLoraProblem& p) {
  return p.num_outputs == 1 && p.accumulate && p.dtype != PUNICA_FLOAT32 && p.num_tokens > kPerTokenMaxTokens &&
         p.max_rank <= kTiledMaxRank;
}

bool split_by_runs(const PunicaLoraProblem& p) { return p.long_run_slots != nullptr && p.short_run_slots != nullptr; }

// The two halves of a split tiled call: each the same problem over its own positions.
PunicaLoraProblem long_runs(const PunicaLoraProblem& p) {
  PunicaLoraProblem part = p;
  part.sorted_slots = p.long_run_slots;
  return part;
}
PunicaLoraProblem short_runs(const PunicaLoraProblem& p) {
  PunicaLoraProblem part = p;
  part.sorted_slots = p.short_run_slots;
  return part;
}

size_t per_token_workspace_floats(const PunicaLoraProblem& p) {
  return punica_fused_fits(p) ? 0 : punica_per_token_workspace_floats(p);
}

cudaError_t per_token_launch(const PunicaLoraProblem& p, float* workspace, cudaStream_t stream) {
  return punica_fused_fits(p) ? punica_fused_launch(p, stream) : punica_per_token_launch(p, nullptr, workspace, stream);
}

}  // namespace

extern "C" size_t punica_lora_workspace_floats(const PunicaLoraProblem* problem) {
  const PunicaLoraProblem& p = *problem;
  if (!use_tiled(p)) return per_token_workspace_floats(p);
  if (!split_by_runs(p)) return punica_tiled_workspace_floats(p);
  return punica_tiled_workspace_floats(long_runs(p)) + punica_per_token_workspace_floats(short_runs(p));
}

extern "C" cudaError_t punica_lora_add(const PunicaLoraProblem* problem, float* workspace, cudaStream_t stream) {
  const PunicaLoraProblem& p = *problem;
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.max_rank == 0 || p.num_slots == 0) {  // no update: a written y is all zeros
    const size_t bytes = static_cast<size_t>(p.num_tokens) * p.hidden_out * (p.dtype == PUNICA_FLOAT32 ? 4 : 2);
    return p.accumulate ? cudaSuccess : cudaMemsetAsync(p.y, 0, bytes, stream);
  }
  if (!use_tiled(p)) return per_token_launch(p, workspace, stream);
  if (!split_by_runs(p)) return punica_tiled_launch(p, workspace, stream);
  const PunicaLoraProblem tiled = long_runs(p);
  const cudaError_t err = punica_tiled_launch(tiled, workspace, stream);
  if (err != cudaSuccess) return err;
  // Disjoint rows of y, one launch after the other: the per-token kernels start once the tiled ones are done. Above
  // kPerTokenMaxTokens the fused kernel never takes a call, so the short half runs the two launches.
  float* short_workspace = workspace + punica_tiled_workspace_floats(tiled);
  return punica_per_token_launch(short_runs(p), p.short_run_chunk_starts, short_workspace, stream);
}
