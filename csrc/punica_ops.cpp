// Torch binding: registers punica_hf::lora_add as a torch.library op (CUDA kernel here; the fake/meta
// implementation is registered from Python in punica_hf/ops/cuda.py). Argument checks with user-facing
// messages live in Python; the checks here guard memory safety only (shapes, dtypes, devices, alignment).
// The factor offsets are trusted (the adapter store writes them); the kernels never read a slot of rank 0.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "punica_lora.h"

namespace {

constexpr int64_t kMaxRank = 1024;

PunicaDtype to_punica_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return PUNICA_FLOAT32;
    case at::kHalf: return PUNICA_FLOAT16;
    case at::kBFloat16: return PUNICA_BFLOAT16;
    default: TORCH_CHECK_VALUE(false, "punica_hf::lora_add: unsupported dtype ", dtype);
  }
}

// Integers enter messages as std::to_string text, never through operator<<: on the H200 machine (torch 2.11) every
// check whose message streamed an integer killed the process (SIGSEGV) instead of raising, while checks streaming
// only text and devices raised. Suspected, not proven: number formatting through another libstdc++'s locale
// facets (benchmarks/KERNEL_NOTES.md, the binding crash).
std::string text(int64_t value) { return std::to_string(value); }

void check_on_device(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK_VALUE(t.is_cuda() && t.device() == like.device(), "punica_hf::lora_add: ", name,
                    " must be on ", like.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), "punica_hf::lora_add: ", name, " must be contiguous");
}

void check_vector(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t size, const at::Tensor& like) {
  check_on_device(t, name, like);
  TORCH_CHECK_VALUE(t.scalar_type() == dtype && t.dim() == 1 && t.size(0) == size, "punica_hf::lora_add: ", name,
                    " must be ", dtype, " of shape [", text(size), "]");
}

void check_aligned(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "punica_hf::lora_add: ", name,
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
  TORCH_CHECK(err == cudaSuccess, "punica_hf::lora_add: ", cudaGetErrorString(err));
  return value;
}

const DeviceInfo& device_info(int device) {
  static std::once_flag read[PUNICA_MAX_DEVICES];
  static DeviceInfo info[PUNICA_MAX_DEVICES];
  TORCH_CHECK(device >= 0 && device < PUNICA_MAX_DEVICES, "punica_hf::lora_add: device index ", text(device), " above ",
              text(PUNICA_MAX_DEVICES - 1));
  // A failed read throws out of call_once, which leaves the flag unset: the next call tries again.
  std::call_once(read[device], [device] {
    info[device] = {device_attribute(cudaDevAttrMultiProcessorCount, device),
                    device_attribute(cudaDevAttrComputeCapabilityMajor, device)};
  });
  return info[device];
}

// Programmatic dependent launch of the expand kernel: on sm_90+, unless PUNICA_HF_PDL=0 (for comparisons and
// bug triage; read at every call, so a graph captured after changing it follows it).
bool programmatic_launch(const DeviceInfo& info) {
  const char* setting = std::getenv("PUNICA_HF_PDL");
  if (setting != nullptr && std::strcmp(setting, "0") == 0) return false;
  return info.compute_major >= 9;
}

// y [T, H_out] += per-token LoRA of x [T, H_in] with factors read from `pool`; see punica_lora.h for the layout.
// segment_starts / segment_slots belong to the op's schema (the PyTorch reference loops over them); the kernels
// find the adapter runs from sorted_token_ids and sorted_slots directly and only check their shapes.
void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& pool, const at::Tensor& a_offsets,
              const at::Tensor& b_offsets, const at::Tensor& lora_ranks, const at::Tensor& sorted_token_ids,
              const at::Tensor& sorted_slots, const at::Tensor& segment_starts, const at::Tensor& segment_slots,
              int64_t max_rank) {
  TORCH_CHECK_VALUE(y.dim() == 2 && x.dim() == 2 && pool.dim() == 1 && lora_ranks.dim() == 1 &&
                        segment_slots.dim() == 1,
                    "punica_hf::lora_add: expected y, x 2-D and pool, lora_ranks, segment_slots 1-D");
  const int64_t num_tokens = x.size(0), hidden_in = x.size(1), hidden_out = y.size(1);
  const int64_t num_slots = lora_ranks.size(0), num_segments = segment_slots.size(0);
  TORCH_CHECK_VALUE(y.size(0) == num_tokens, "punica_hf::lora_add: y and x have different token counts");
  TORCH_CHECK_VALUE(hidden_in % 8 == 0 && hidden_out % 8 == 0,
                    "punica_hf::lora_add: hidden sizes must be multiples of 8");
  TORCH_CHECK_VALUE(max_rank >= 1 && max_rank <= kMaxRank, "punica_hf::lora_add: max_rank must be in [1, ", text(kMaxRank),
                    "]");
  TORCH_CHECK_VALUE(x.scalar_type() == y.scalar_type() && pool.scalar_type() == y.scalar_type(),
                    "punica_hf::lora_add: y, x and pool must share one dtype");
  check_on_device(y, "y", y);
  check_on_device(x, "x", y);
  check_on_device(pool, "pool", y);
  check_aligned(y, "y");
  check_aligned(x, "x");
  check_aligned(pool, "pool");
  check_vector(lora_ranks, "lora_ranks", at::kInt, num_slots, y);
  check_vector(a_offsets, "a_offsets", at::kLong, num_slots, y);
  check_vector(b_offsets, "b_offsets", at::kLong, num_slots, y);
  check_vector(sorted_token_ids, "sorted_token_ids", at::kInt, num_tokens, y);
  check_vector(sorted_slots, "sorted_slots", at::kInt, num_tokens, y);
  check_vector(segment_slots, "segment_slots", at::kInt, num_segments, y);
  check_vector(segment_starts, "segment_starts", at::kInt, num_segments + 1, y);
  TORCH_CHECK_VALUE(num_tokens * std::max(hidden_in, hidden_out) < (int64_t{1} << 31) && num_slots < (int64_t{1} << 31),
                    "punica_hf::lora_add: tensors too large");

  const c10::cuda::CUDAGuard device_guard(y.device());
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
  const DeviceInfo& info = device_info(device);
  problem.device = device;
  problem.num_sms = info.num_sms;
  problem.programmatic_launch = programmatic_launch(info) ? 1 : 0;
  problem.dtype = to_punica_dtype(y.scalar_type());

  // Scratch for the fp32 partials of v: from the caching allocator, so graph capture and reuse are free.
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(punica_lora_workspace_floats(&problem))}, y.options().dtype(at::kFloat));
  const cudaError_t err = punica_lora_add(&problem, workspace.data_ptr<float>(), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "punica_hf::lora_add: CUDA error: ", cudaGetErrorString(err));
}

}  // namespace

TORCH_LIBRARY(punica_hf, m) {
  m.def(
      "lora_add(Tensor(a!) y, Tensor x, Tensor pool, Tensor a_offsets, Tensor b_offsets, Tensor lora_ranks, "
      "Tensor sorted_token_ids, Tensor sorted_slots, Tensor segment_starts, Tensor segment_slots, int max_rank) -> ()");
}

TORCH_LIBRARY_IMPL(punica_hf, CUDA, m) { m.impl("lora_add", &lora_add); }
