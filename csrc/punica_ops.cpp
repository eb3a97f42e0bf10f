// Torch binding: registers punica_hf::lora_add as a torch.library op (CUDA kernel here; the fake/meta
// implementation is registered from Python in punica_hf/ops/cuda.py). Argument checks with user-facing
// messages live in Python; the checks here guard memory safety only.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "punica_lora.h"

namespace {

PunicaDtype to_punica_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return PUNICA_FLOAT32;
    case at::kHalf: return PUNICA_FLOAT16;
    case at::kBFloat16: return PUNICA_BFLOAT16;
    default: TORCH_CHECK_VALUE(false, "punica_hf::lora_add: unsupported dtype ", dtype);
  }
}

void check_cuda_contiguous(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK_VALUE(t.is_cuda() && t.device() == like.device(), "punica_hf::lora_add: ", name,
                    " must be on ", like.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), "punica_hf::lora_add: ", name, " must be contiguous");
}

void check_int32(const at::Tensor& t, const char* name, int64_t size, const at::Tensor& like) {
  check_cuda_contiguous(t, name, like);
  TORCH_CHECK_VALUE(t.scalar_type() == at::kInt && t.dim() == 1 && t.size(0) == size, "punica_hf::lora_add: ",
                    name, " must be int32 of shape [", size, "]");
}

// ATen/cuda/CUDAContext.h would do, but pulls in cuSPARSE/cuBLAS headers that minimal CUDA installs lack.
int multiprocessor_count(int device) {
  int count = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  TORCH_CHECK(err == cudaSuccess, "punica_hf::lora_add: ", cudaGetErrorString(err));
  return count;
}

// y [T, H_out] += per-token LoRA of x [T, H_in]; see punica_lora.h for every shape.
void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
              const at::Tensor& lora_ranks, const at::Tensor& token_slots, const at::Tensor& sorted_token_ids,
              const at::Tensor& segment_starts, const at::Tensor& segment_slots) {
  TORCH_CHECK_VALUE(y.dim() == 2 && x.dim() == 2 && lora_a.dim() == 3 && lora_b.dim() == 3,
                    "punica_hf::lora_add: expected y, x 2-D and lora_a, lora_b 3-D");
  const int64_t num_tokens = x.size(0), hidden_in = x.size(1), hidden_out = y.size(1);
  const int64_t num_slots = lora_a.size(0), max_rank = lora_a.size(1), num_segments = segment_slots.size(0);
  TORCH_CHECK_VALUE(y.size(0) == num_tokens && lora_a.size(2) == hidden_in && lora_b.size(0) == num_slots &&
                        lora_b.size(1) == hidden_out && lora_b.size(2) == max_rank,
                    "punica_hf::lora_add: inconsistent shapes");
  TORCH_CHECK_VALUE(hidden_in % 8 == 0 && hidden_out % 8 == 0, "punica_hf::lora_add: hidden sizes must be multiples of 8");
  for (const at::Tensor* t : {&x, &lora_a, &lora_b}) {
    TORCH_CHECK_VALUE(t->scalar_type() == y.scalar_type(), "punica_hf::lora_add: dtypes differ");
  }
  check_cuda_contiguous(y, "y", y);
  check_cuda_contiguous(x, "x", y);
  check_cuda_contiguous(lora_a, "lora_a", y);
  check_cuda_contiguous(lora_b, "lora_b", y);
  check_int32(lora_ranks, "lora_ranks", num_slots, y);
  check_int32(token_slots, "token_slots", num_tokens, y);
  check_int32(sorted_token_ids, "sorted_token_ids", num_tokens, y);
  check_int32(segment_starts, "segment_starts", num_segments + 1, y);
  check_int32(segment_slots, "segment_slots", num_segments, y);
  TORCH_CHECK_VALUE(num_tokens * std::max(hidden_in, hidden_out) < (int64_t{1} << 31) &&
                        num_slots * max_rank * std::max(hidden_in, hidden_out) < (int64_t{1} << 40),
                    "punica_hf::lora_add: tensors too large");

  const c10::cuda::CUDAGuard device_guard(y.device());
  PunicaLoraProblem problem{};
  problem.y = y.data_ptr();
  problem.x = x.data_ptr();
  problem.lora_a = lora_a.data_ptr();
  problem.lora_b = lora_b.data_ptr();
  problem.lora_ranks = lora_ranks.data_ptr<int32_t>();
  problem.token_slots = token_slots.data_ptr<int32_t>();
  problem.sorted_token_ids = sorted_token_ids.data_ptr<int32_t>();
  problem.segment_starts = segment_starts.data_ptr<int32_t>();
  problem.segment_slots = segment_slots.data_ptr<int32_t>();
  problem.num_tokens = static_cast<int>(num_tokens);
  problem.hidden_in = static_cast<int>(hidden_in);
  problem.hidden_out = static_cast<int>(hidden_out);
  problem.max_rank = static_cast<int>(max_rank);
  problem.num_slots = static_cast<int>(num_slots);
  problem.num_segments = static_cast<int>(num_segments);
  problem.num_sms = multiprocessor_count(y.get_device());
  problem.dtype = to_punica_dtype(y.scalar_type());

  // Scratch for the fp32 intermediate v: from the caching allocator, so graph capture and reuse are free.
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(punica_lora_workspace_floats(&problem))}, y.options().dtype(at::kFloat));
  const cudaError_t err = punica_lora_add(&problem, workspace.data_ptr<float>(), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "punica_hf::lora_add: CUDA error: ", cudaGetErrorString(err));
}

}  // namespace

TORCH_LIBRARY(punica_hf, m) {
  m.def(
      "lora_add(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor lora_ranks, Tensor token_slots, "
      "Tensor sorted_token_ids, Tensor segment_starts, Tensor segment_slots) -> ()");
}

TORCH_LIBRARY_IMPL(punica_hf, CUDA, m) { m.impl("lora_add", &lora_add); }
