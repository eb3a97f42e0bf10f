"""MultiLoraModel on a GPU, through the CUDA kernels, equals the CPU path (which equals PEFT, test_parity.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from architectures import ARCHITECTURES, left_padded_batch, make_base_and_adapters

from punica_hf import MultiLoraModel, ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
ROW_ADAPTERS = ["attn", None, "all", "mlp_layer1", "regex", "attn"]


@pytest.fixture(autouse=True)
def cuda_kernels_in_use():
    # Under the default backend choice a failed kernel build falls back to PyTorch: that must fail here.
    assert ops.backend_for(torch.device("cuda")) == "cuda"


def _wrapped(base, paths, device, dtype):
    model = MultiLoraModel(copy.deepcopy(base).to(device=device, dtype=dtype), max_adapters=6, max_rank=8)
    model.load_adapters(paths)
    return model


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@torch.no_grad()
def test_gpu_logits_and_greedy_tokens_match_cpu(arch, tmp_path):
    base, paths = make_base_and_adapters(arch, tmp_path)
    cpu = _wrapped(base, paths, "cpu", torch.float32)
    gpu = _wrapped(base, paths, "cuda", torch.float32)
    input_ids, attention_mask = left_padded_batch([7, 4, 9, 9, 2, 6])
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    expected = cpu(**batch, adapter_ids=ROW_ADAPTERS).logits
    logits = gpu(**{k: v.cuda() for k, v in batch.items()}, adapter_ids=ROW_ADAPTERS).logits.cpu()
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], expected[real], atol=1e-4, rtol=1e-4)

    kwargs = dict(max_new_tokens=6, do_sample=False)
    expected_tokens = cpu.generate(input_ids, attention_mask=attention_mask, adapter_ids=ROW_ADAPTERS, **kwargs)
    tokens = gpu.generate(input_ids.cuda(), attention_mask=attention_mask.cuda(), adapter_ids=ROW_ADAPTERS, **kwargs)
    assert torch.equal(tokens.cpu(), expected_tokens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_gpu_half_precision_logits_close_to_fp32(dtype, tmp_path):
    base, paths = make_base_and_adapters("llama", tmp_path)
    cpu = _wrapped(base, paths, "cpu", torch.float32)
    gpu = _wrapped(base, paths, "cuda", dtype)
    input_ids, attention_mask = left_padded_batch([7, 4, 9, 9, 2, 6])
    expected = cpu(input_ids=input_ids, attention_mask=attention_mask, adapter_ids=ROW_ADAPTERS).logits
    logits = gpu(input_ids=input_ids.cuda(), attention_mask=attention_mask.cuda(), adapter_ids=ROW_ADAPTERS).logits
    real = attention_mask.bool()
    error = (logits.float().cpu()[real] - expected[real]).norm() / expected[real].norm()
    assert error < 2e-2


@torch.no_grad()
def test_static_cache_compiled_decode_matches_eager_and_does_not_recompile(tmp_path, monkeypatch):
    base, paths = make_base_and_adapters("llama", tmp_path)
    gpu = _wrapped(base, paths, "cuda", torch.float32)
    input_ids, attention_mask = left_padded_batch([7, 4, 9, 9, 2, 6])
    input_ids, attention_mask = input_ids.cuda(), attention_mask.cuda()
    kwargs = dict(max_new_tokens=6, do_sample=False, attention_mask=attention_mask)
    for rows in (ROW_ADAPTERS, ROW_ADAPTERS[::-1]):
        eager = gpu.generate(input_ids, adapter_ids=rows, **kwargs)
        compiled = gpu.generate(input_ids, adapter_ids=rows, cache_implementation="static", **kwargs)
        assert torch.equal(compiled, eager)
        # the second adapter mix must reuse the compiled graphs
        monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)


@torch.no_grad()
def test_compiled_decode_applies_an_adapter_that_hooks_new_modules(tmp_path):
    """An adapter loaded after a compiled static-cache generate() that hooks modules no earlier adapter targeted
    (the MLP's, here) is applied by the next compiled generate, as by an eager one."""
    base, paths = make_base_and_adapters("llama", tmp_path)
    gpu = _wrapped(base, {"attn": paths["attn"]}, "cuda", torch.float32)
    input_ids, attention_mask = left_padded_batch([7, 4, 9, 9, 2, 6])
    input_ids, attention_mask = input_ids.cuda(), attention_mask.cuda()
    kwargs = dict(max_new_tokens=6, do_sample=False, attention_mask=attention_mask)
    for adapters in (["attn", None, "attn", None, "attn", "attn"], ["all", "attn", None, "all", "attn", "all"]):
        if "all" in adapters:
            gpu.load_adapters({"all": paths["all"]})  # hooks gate/up/down, untouched by "attn"
        eager = gpu.generate(input_ids, adapter_ids=adapters, **kwargs)
        compiled = gpu.generate(input_ids, adapter_ids=adapters, cache_implementation="static", **kwargs)
        assert torch.equal(compiled, eager), adapters
