// Torch binding: registers punica_hf::lora_add, punica_hf::lora_delta, punica_hf::paged_attention and
// punica_hf::rms_norm as torch.library ops (CUDA kernels here; the fake implementations are registered from Python in
// punica_hf/ops/cuda.py). Argument checks with user-facing messages live in Python; the checks here guard memory
// safety only (shapes, dtypes, devices, alignment).
// The factor offsets are trusted (the adapter store writes them); the kernels never read a slot of rank 0.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <mutex>
#include <string>

#include "punica_attention.h"
#include "punica_lora.h"
#include "punica_norm.h"

namespace {

constexpr int64_t kMaxRank = 1024;
constexpr const char* kAdd = "punica_hf::lora_add";  // the op named in its error messages
constexpr const char* kDelta = "punica_hf::lora_delta";
constexpr const char* kAttention = "punica_hf::paged_attention";
constexpr const char* kRmsNorm = "punica_hf::rms_norm";

PunicaDtype to_punica_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return PUNICA_FLOAT32;
    case at::kHalf: return PUNICA_FLOAT16;
    case at::kBFloat16: return PUNICA_BFLOAT16;
    default: TORCH_CHECK_VALUE(false, "punica_hf: unsupported dtype ", dtype);
  }
}

// Integers enter messages as std::to_string text, never through operator<<: on one GPU machine (torch 2.11) every
// check whose message streamed an integer killed the process (SIGSEGV) instead of raising, while checks streaming
// only text and devices raised. Suspected, not proven: number formatting through another libstdc++'s locale
// facets (benchmarks/KERNEL_NOTES.md, the binding crash).
std::string text(int64_t value) { return std::to_string(value); }

void check_on_device(const char* op, const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK_VALUE(t.is_cuda() && t.device() == like.device(), op, ": ", name,
                    " must be on ", like.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// `t` must be on like's device, contiguous, of `dtype` and of shape `sizes` (the message is built only on failure:
// this runs for five tables at every call).
void check_table(const char* op, const at::Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef sizes,
                 const at::Tensor& like) {
  check_on_device(op, t, name, like);
  if (t.scalar_type() == dtype && t.sizes() == sizes) return;
  std::string shape = "[";
  for (size_t i = 0; i < sizes.size(); ++i) shape += (i ? ", " : "") + text(sizes[i]);
  TORCH_CHECK_VALUE(false, op, ": ", name, " must be ", dtype, " of shape ", shape, "]");
}

void check_aligned(const char* op, const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": ", name,
                    " must be 16-byte aligned");
}

// Static properties of one device, read once per device (cudaDeviceGetAttribute costs host time at every call).
struct DeviceInfo {
  int num_sms;
  int compute_major;
};

// ATen/cuda/CUDAContext.h would do, but pulls in cuSPARSE/cuBLAS headers that minimal CUDA installs lack.
int device_attribute(cudaDeviceAttr attribute, int device) {
  int value = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&value, attribute, device);
  TORCH_CHECK(err == cudaSuccess, "punica_hf: ", cudaGetErrorString(err));
  return value;
}

const DeviceInfo& device_info(int device) {
  static std::once_flag read[PUNICA_MAX_DEVICES];
  static DeviceInfo info[PUNICA_MAX_DEVICES];
  TORCH_CHECK(device >= 0 && device < PUNICA_MAX_DEVICES, "punica_hf: device index ", text(device), " above ",
              text(PUNICA_MAX_DEVICES - 1));
  // A failed read throws out of call_once, which leaves the flag unset: the next call tries again.
  std::call_once(read[device], [device] {
    info[device] = {device_attribute(cudaDevAttrMultiProcessorCount, device),
                    device_attribute(cudaDevAttrComputeCapabilityMajor, device)};
  });
  return info[device];
}

// The checked problem of y [..., H_out] += LoRA of x [..., H_in] for G outputs (G = out_features.size()): the
// leading dimensions are the T tokens (contiguous, so flattened as they are); output g is columns
// [sum of out_features[:g], + out_features[g]) of y, with row g of the [G, S] tables (a_offsets, b_offsets,
// lora_ranks); see punica_lora.h for the layout.
PunicaLoraProblem make_problem(const char* op, const at::Tensor& y, const at::Tensor& x, const at::Tensor& pool,
                               const at::Tensor& a_offsets, const at::Tensor& b_offsets, const at::Tensor& lora_ranks,
                               const at::Tensor& sorted_token_ids, const at::Tensor& sorted_slots,
                               at::IntArrayRef out_features, int64_t max_rank, bool programmatic_launch, bool fused) {
  TORCH_CHECK_VALUE(y.dim() >= 2 && x.dim() >= 2 && pool.dim() == 1 && lora_ranks.dim() >= 1,
                    op, ": expected y [..., H_out], x [..., H_in], pool 1-D and a lora_ranks table");
  const int64_t num_outputs = static_cast<int64_t>(out_features.size());
  TORCH_CHECK_VALUE(num_outputs >= 1 && num_outputs <= PUNICA_MAX_OUTPUTS, op, ": from 1 to ",
                    text(PUNICA_MAX_OUTPUTS), " outputs per call");
  const int64_t hidden_in = x.size(-1), hidden_out = y.size(-1);
  TORCH_CHECK_VALUE(hidden_in > 0 && hidden_out > 0, op, ": hidden sizes must be positive");
  const int64_t num_tokens = x.numel() / hidden_in;
  const int64_t num_slots = lora_ranks.size(-1);
  TORCH_CHECK_VALUE(y.numel() / hidden_out == num_tokens, op, ": y and x have different token counts");
  int64_t columns = 0;
  for (const int64_t width : out_features) {
    TORCH_CHECK_VALUE(width > 0 && width % 8 == 0, op, ": hidden sizes must be multiples of 8");
    columns += width;
  }
  TORCH_CHECK_VALUE(columns == hidden_out, op, ": y's width must be the sum of the outputs' widths");
  TORCH_CHECK_VALUE(hidden_in % 8 == 0, op, ": hidden sizes must be multiples of 8");
  TORCH_CHECK_VALUE(max_rank >= 1 && max_rank <= kMaxRank, op, ": max_rank must be in [1, ", text(kMaxRank),
                    "]");
  TORCH_CHECK_VALUE(x.scalar_type() == y.scalar_type() && pool.scalar_type() == y.scalar_type(),
                    op, ": y, x and pool must share one dtype");
  check_on_device(op, y, "y", y);
  check_on_device(op, x, "x", y);
  check_on_device(op, pool, "pool", y);
  check_aligned(op, y, "y");
  check_aligned(op, x, "x");
  check_aligned(op, pool, "pool");
  // A plain call's tables are [S], a grouped call's [G, S].
  const int64_t grouped_sizes[2] = {num_outputs, num_slots};
  const at::IntArrayRef table_sizes = num_outputs == 1 && lora_ranks.dim() == 1 ? at::IntArrayRef(&num_slots, 1)
                                                                                : at::IntArrayRef(grouped_sizes, 2);
  check_table(op, lora_ranks, "lora_ranks", at::kInt, table_sizes, y);
  check_table(op, a_offsets, "a_offsets", at::kLong, table_sizes, y);
  check_table(op, b_offsets, "b_offsets", at::kLong, table_sizes, y);
  check_table(op, sorted_token_ids, "sorted_token_ids", at::kInt, {num_tokens}, y);
  check_table(op, sorted_slots, "sorted_slots", at::kInt, {num_tokens}, y);
  TORCH_CHECK_VALUE(num_tokens * std::max(hidden_in, hidden_out) < (int64_t{1} << 31) && num_slots < (int64_t{1} << 31),
                    op, ": tensors too large");

  const int device = y.get_device();
  PunicaLoraProblem problem{};
  problem.y = y.data_ptr();
  problem.x = x.data_ptr();
  problem.pool = pool.data_ptr();
  problem.a_offsets = a_offsets.data_ptr<int64_t>();
  problem.b_offsets = b_offsets.data_ptr<int64_t>();
  problem.lora_ranks = lora_ranks.data_ptr<int32_t>();
  problem.sorted_token_ids = sorted_token_ids.data_ptr<int32_t>();
  problem.sorted_slots = sorted_slots.data_ptr<int32_t>();
  problem.num_tokens = static_cast<int>(num_tokens);
  problem.hidden_in = static_cast<int>(hidden_in);
  problem.hidden_out = static_cast<int>(hidden_out);
  problem.max_rank = static_cast<int>(max_rank);
  problem.num_slots = static_cast<int>(num_slots);
  problem.num_outputs = static_cast<int>(num_outputs);
  problem.accumulate = 1;
  for (int64_t g = 0; g < num_outputs; ++g)
    problem.output_columns[g + 1] = problem.output_columns[g] + static_cast<int>(out_features[g]);
  const DeviceInfo& info = device_info(device);
  problem.device = device;
  problem.num_sms = info.num_sms;
  // The caller's kernel choices (punica_hf.ops.KernelConfig), arguments of the op so that a captured graph or a
  // compiled step keeps the choice it was made with. Both need sm_90+ (programmatic dependent launch of the
  // two-launch paths' expand kernels; thread-block clusters for the fused one-launch per-token path).
  problem.programmatic_launch = info.compute_major >= 9 && programmatic_launch ? 1 : 0;
  problem.fused = info.compute_major >= 9 && fused ? 1 : 0;
  problem.dtype = to_punica_dtype(y.scalar_type());
  return problem;
}

void run(const PunicaLoraProblem& problem, const at::Tensor& y) {
  // Scratch for the fp32 partials of v (none for the fused kernel): from the caching allocator, so graph capture
  // and reuse are free.
  const int64_t floats = static_cast<int64_t>(punica_lora_workspace_floats(&problem));
  const at::Tensor workspace = floats > 0 ? at::empty({floats}, y.options().dtype(at::kFloat)) : at::Tensor();
  float* scratch = floats > 0 ? workspace.data_ptr<float>() : nullptr;
  const cudaError_t err = punica_lora_add(&problem, scratch, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "punica_hf: CUDA error: ", cudaGetErrorString(err));
}

// y [..., H_out] += per-token LoRA of x [..., H_in] (T tokens in the leading dimensions); tables [S].
// long_run_slots / short_run_slots [T] split the positions between the tiled and per-token kernels where the
// tiled path runs; short_runs false: the tiled kernels serve every position (the split's tables are not read).
// short_run_chunk_starts [T]: the list the split's per-token kernels walk (punica_lora.h), read where
// short_run_chunks is set too.
void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& pool, const at::Tensor& a_offsets,
              const at::Tensor& b_offsets, const at::Tensor& lora_ranks, const at::Tensor& sorted_token_ids,
              const at::Tensor& sorted_slots, const at::Tensor& long_run_slots, const at::Tensor& short_run_slots,
              const at::Tensor& short_run_chunk_starts, int64_t max_rank, bool programmatic_launch, bool fused,
              bool short_runs, bool short_run_chunks) {
  TORCH_CHECK_VALUE(y.dim() >= 2 && lora_ranks.dim() == 1,
                    "punica_hf::lora_add: expected y [..., H_out] and lora_ranks 1-D");
  const int64_t hidden_out = y.size(-1);
  PunicaLoraProblem problem =
      make_problem(kAdd, y, x, pool, a_offsets, b_offsets, lora_ranks, sorted_token_ids, sorted_slots, {hidden_out},
                   max_rank, programmatic_launch, fused);
  if (short_runs) {
    check_table(kAdd, long_run_slots, "long_run_slots", at::kInt, {problem.num_tokens}, y);
    check_table(kAdd, short_run_slots, "short_run_slots", at::kInt, {problem.num_tokens}, y);
    problem.long_run_slots = long_run_slots.data_ptr<int32_t>();
    problem.short_run_slots = short_run_slots.data_ptr<int32_t>();
    if (short_run_chunks) {  // entries outside [0, T) end the kernels' walk: never read out of bounds
      check_table(kAdd, short_run_chunk_starts, "short_run_chunk_starts", at::kInt, {problem.num_tokens}, y);
      problem.short_run_chunk_starts = short_run_chunk_starts.data_ptr<int32_t>();
    }
  }
  const c10::cuda::CUDAGuard device_guard(y.device());
  run(problem, y);
}

// The LoRA updates of G projections that share their input x [T, H_in], side by side in a new [T, sum of
// out_features] tensor (zero where a token has no adapter or rank 0); tables [G, S], one row per projection.
// Per-token kernels at any T: callers group projections at decode sizes.
at::Tensor lora_delta(const at::Tensor& x, const at::Tensor& pool, const at::Tensor& a_offsets,
                      const at::Tensor& b_offsets, const at::Tensor& lora_ranks, const at::Tensor& sorted_token_ids,
                      const at::Tensor& sorted_slots, at::IntArrayRef out_features, int64_t max_rank,
                      bool programmatic_launch, bool fused) {
  TORCH_CHECK_VALUE(x.dim() == 2, "punica_hf::lora_delta: expected x 2-D");
  TORCH_CHECK_VALUE(x.is_cuda(), "punica_hf::lora_delta: x must be on a CUDA device");
  const c10::cuda::CUDAGuard device_guard(x.device());
  int64_t columns = 0;
  for (const int64_t width : out_features) columns += width;
  const at::Tensor y = at::empty({x.size(0), columns}, x.options());  // written whole by the kernels
  PunicaLoraProblem problem = make_problem(kDelta, y, x, pool, a_offsets, b_offsets, lora_ranks, sorted_token_ids,
                                           sorted_slots, out_features, max_rank, programmatic_launch, fused);
  problem.accumulate = 0;
  run(problem, y);
  return y;
}

// A paged KV cache: [N, Hkv, D] with each slot's [Hkv, D] block dense and slots a multiple of 8 elements apart (a
// view of transformers' [pages, page_size, Hkv, D] storage may have any such slot stride), 16-byte aligned.
void check_cache(const at::Tensor& cache, const char* name, const at::Tensor& query) {
  TORCH_CHECK_VALUE(cache.is_cuda() && cache.device() == query.device(), kAttention, ": ", name, " must be on ",
                    query.device());
  const bool dense_slots = (cache.size(1) <= 1 || cache.stride(1) == cache.size(2)) && cache.stride(2) == 1;
  TORCH_CHECK_VALUE(dense_slots, kAttention, ": ", name, "'s [Hkv, D] slots must be contiguous");
  TORCH_CHECK_VALUE(cache.size(0) <= 1 || cache.stride(0) % 8 == 0, kAttention, ": ", name,
                    "'s slot stride must be a multiple of 8 elements");
  check_aligned(kAttention, cache, name);
}

// The slot stride of a checked cache (any value for a single slot: only slot 0 is ever read).
int64_t slot_stride(const at::Tensor& cache) { return cache.size(0) <= 1 ? 0 : cache.stride(0); }

// out [Tq, Hq, D] = causal attention of the packed query rows over the paged cache; see punica_attention.h.
// splits: 0 = the launcher's choice from the shapes, else the number of key splits per row to use.
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& key_slots, const at::Tensor& cu_seq_lens_q,
                           const at::Tensor& cu_seq_lens_k, double scale, int64_t splits) {
  const char* op = kAttention;
  TORCH_CHECK_VALUE(splits >= 0 && splits <= PUNICA_ATTENTION_MAX_SPLITS, op, ": splits must be in [0, ",
                    text(PUNICA_ATTENTION_MAX_SPLITS), "]");
  TORCH_CHECK_VALUE(query.dim() == 3 && key_cache.dim() == 3 && value_cache.dim() == 3, op,
                    ": expected query [Tq, Hq, D], key_cache and value_cache [N, Hkv, D]");
  TORCH_CHECK_VALUE(query.is_cuda(), op, ": query must be on a CUDA device");
  const c10::cuda::CUDAGuard device_guard(query.device());
  const int64_t num_rows = query.size(0), num_q_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_cache_slots = key_cache.size(0), num_kv_heads = key_cache.size(1);
  TORCH_CHECK_VALUE(key_cache.sizes() == value_cache.sizes(), op, ": key_cache and value_cache must have one shape");
  TORCH_CHECK_VALUE(key_cache.size(2) == head_dim, op, ": the caches' head size must be query's");
  TORCH_CHECK_VALUE(head_dim == 64 || head_dim == 128 || head_dim == 256, op, ": head size must be 64, 128 or 256");
  TORCH_CHECK_VALUE(num_kv_heads >= 1 && num_q_heads >= num_kv_heads && num_q_heads % num_kv_heads == 0, op,
                    ": query heads must be a positive multiple of kv heads");
  const at::ScalarType dtype = query.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kHalf || dtype == at::kBFloat16, op, ": dtype must be float16 or bfloat16");
  TORCH_CHECK_VALUE(key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype, op,
                    ": query, key_cache and value_cache must share one dtype");
  check_on_device(op, query, "query", query);
  check_aligned(op, query, "query");
  check_cache(key_cache, "key_cache", query);
  check_cache(value_cache, "value_cache", query);
  const bool slot_dtype = key_slots.scalar_type() == at::kInt || key_slots.scalar_type() == at::kLong;
  TORCH_CHECK_VALUE(key_slots.dim() == 1 && slot_dtype, op, ": key_slots must be 1-D int32 or int64");
  check_on_device(op, key_slots, "key_slots", query);
  TORCH_CHECK_VALUE(cu_seq_lens_q.dim() == 1 && cu_seq_lens_q.size(0) >= 1, op,
                    ": cu_seq_lens_q must be 1-D with B + 1 >= 1 entries");
  const int64_t num_seqs = cu_seq_lens_q.size(0) - 1;
  check_table(op, cu_seq_lens_q, "cu_seq_lens_q", at::kInt, {num_seqs + 1}, query);
  check_table(op, cu_seq_lens_k, "cu_seq_lens_k", at::kInt, {num_seqs + 1}, query);
  constexpr int64_t kIntLimit = int64_t{1} << 30;  // row / key / slot arithmetic in the kernel stays in int
  TORCH_CHECK_VALUE(num_rows < kIntLimit && key_slots.size(0) < kIntLimit && num_cache_slots < kIntLimit &&
                        num_seqs < kIntLimit && num_q_heads < kIntLimit,
                    op, ": tensors too large");

  const at::Tensor out = at::empty({num_rows, num_q_heads, head_dim}, query.options());  // written whole
  PunicaAttentionProblem problem{};
  problem.out = out.data_ptr();
  problem.query = query.data_ptr();
  problem.key_cache = key_cache.data_ptr();
  problem.value_cache = value_cache.data_ptr();
  problem.key_slots = key_slots.data_ptr();
  problem.cu_seq_lens_q = cu_seq_lens_q.data_ptr<int32_t>();
  problem.cu_seq_lens_k = cu_seq_lens_k.data_ptr<int32_t>();
  problem.key_slot_stride = slot_stride(key_cache);
  problem.value_slot_stride = slot_stride(value_cache);
  problem.num_cache_slots = num_cache_slots;
  problem.num_query_rows = static_cast<int>(num_rows);
  problem.num_key_slots = static_cast<int>(key_slots.size(0));
  problem.num_seqs = static_cast<int>(num_seqs);
  problem.num_q_heads = static_cast<int>(num_q_heads);
  problem.num_kv_heads = static_cast<int>(num_kv_heads);
  problem.head_dim = static_cast<int>(head_dim);
  problem.slot_index_bytes = key_slots.scalar_type() == at::kLong ? 8 : 4;
  problem.scale = static_cast<float>(scale);
  problem.num_splits = static_cast<int>(splits);
  const int device = query.get_device();
  problem.device = device;
  problem.num_sms = device_info(device).num_sms;
  problem.dtype = to_punica_dtype(dtype);
  // Partials of the key splits (none with one split): from the caching allocator, so graph capture and reuse are free.
  const int64_t floats = static_cast<int64_t>(punica_paged_attention_workspace_floats(&problem));
  const at::Tensor workspace = floats > 0 ? at::empty({floats}, query.options().dtype(at::kFloat)) : at::Tensor();
  const cudaError_t err =
      punica_paged_attention(&problem, floats > 0 ? workspace.data_ptr<float>() : nullptr,
                             c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "punica_hf: CUDA error: ", cudaGetErrorString(err));
  return out;
}

// out [..., H] = the RMSNorm of each row of x [..., H] scaled by weight [H]; see punica_norm.h.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const char* op = kRmsNorm;
  TORCH_CHECK_VALUE(x.dim() >= 1 && weight.dim() == 1, op, ": expected x [..., H] and weight [H]");
  TORCH_CHECK_VALUE(x.is_cuda(), op, ": x must be on a CUDA device");
  const c10::cuda::CUDAGuard device_guard(x.device());
  check_on_device(op, x, "x", x);
  check_on_device(op, weight, "weight", x);
  const int64_t hidden = x.size(-1);
  TORCH_CHECK_VALUE(weight.size(0) == hidden, op, ": weight must have x's last size");
  TORCH_CHECK_VALUE(hidden >= 1 && hidden < (int64_t{1} << 30), op, ": the rows' width must be in [1, 2^30)");
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type(), op, ": x and weight must share one dtype");
  const at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);  // written whole
  PunicaRmsNormProblem problem{};
  problem.out = out.data_ptr();
  problem.x = x.data_ptr();
  problem.weight = weight.data_ptr();
  problem.num_rows = hidden == 0 ? 0 : x.numel() / hidden;
  problem.hidden = static_cast<int>(hidden);
  problem.eps = static_cast<float>(eps);
  problem.dtype = to_punica_dtype(x.scalar_type());
  TORCH_CHECK_VALUE(problem.num_rows < (int64_t{1} << 31), op, ": too many rows");
  const cudaError_t err = punica_rms_norm(&problem, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "punica_hf: CUDA error: ", cudaGetErrorString(err));
  return out;
}

}  // namespace

TORCH_LIBRARY(punica_hf, m) {
  // The trailing bool / int arguments are kernel choices (punica_hf.ops.KernelConfig, the attention's split count):
  // constants of a compiled graph, so a change recompiles rather than silently keeping the old choice.
  m.def(
      "lora_add(Tensor(a!) y, Tensor x, Tensor pool, Tensor a_offsets, Tensor b_offsets, Tensor lora_ranks, "
      "Tensor sorted_token_ids, Tensor sorted_slots, Tensor long_run_slots, Tensor short_run_slots, "
      "Tensor short_run_chunk_starts, int max_rank, bool programmatic_launch, bool fused, bool short_runs, "
      "bool short_run_chunks) -> ()");
  m.def(
      "lora_delta(Tensor x, Tensor pool, Tensor a_offsets, Tensor b_offsets, Tensor lora_ranks, "
      "Tensor sorted_token_ids, Tensor sorted_slots, int[] out_features, int max_rank, bool programmatic_launch, "
      "bool fused) -> Tensor");
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor key_slots, Tensor cu_seq_lens_q, "
      "Tensor cu_seq_lens_k, float scale, int splits) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(punica_hf, CUDA, m) {
  m.impl("lora_add", &lora_add);
  m.impl("lora_delta", &lora_delta);
  m.impl("paged_attention", &paged_attention);
  m.impl("rms_norm", &rms_norm);
}
