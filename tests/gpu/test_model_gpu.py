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
    assert isinstance(ops.backend_for(torch.device("cuda")), ops.CudaLoraBackend)


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


@torch.no_grad()
def test_a_forward_captured_in_a_cuda_graph_groups_its_projections_and_replays_new_slots(tmp_path, monkeypatch):
    """An eager forward captured in a CUDA graph (as the serving engine captures its steps) computes q/k/v and
    gate/up with one grouped call each, and every replay gives the eager forward's logits for the slots then in
    the graph's input."""
    from punica_hf.ops import cuda as cuda_ops

    base, paths = make_base_and_adapters("llama", tmp_path)
    gpu = _wrapped(base, paths, "cuda", torch.float32)
    names = list(paths)
    input_ids = torch.randint(1, base.config.vocab_size, (6, 9), device="cuda")
    with gpu.acquire(names) as lease:
        row_slots = torch.full((6,), -1, dtype=torch.int32, device="cuda")
        calls = {"add": 0, "delta": 0}
        for kind, name in (("add", "lora_add_unchecked"), ("delta", "lora_delta_unchecked")):
            def counted(*args, _kind=kind, _op=getattr(cuda_ops.CudaLoraBackend, name), **kwargs):
                calls[_kind] += 1
                return _op(*args, **kwargs)  # args[0]: the backend (a method of the class)
            monkeypatch.setattr(cuda_ops.CudaLoraBackend, name, counted)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the warm-up PyTorch asks for before a capture
            gpu.model(input_ids=input_ids, adapter_ids=row_slots, use_cache=False)
        torch.cuda.current_stream().wait_stream(side)
        eager_calls = dict(calls)
        assert eager_calls["delta"] == 0  # eager: one in-place call per projection, no group
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = gpu.model(input_ids=input_ids, adapter_ids=row_slots, use_cache=False).logits
        captured = {kind: calls[kind] - eager_calls[kind] for kind in calls}
        layers = base.config.num_hidden_layers
        # per layer: one call for q/k/v and one for gate/up (where the layer has them), one each for o and down
        assert 0 < captured["delta"] <= 2 * layers and captured["add"] < eager_calls["add"]
        for mapping in ([0, -1, 1, 2, 3, 0], [3, 3, 2, -1, 0, 1], [-1] * 6):  # indices into names
            row_slots.copy_(torch.tensor([lease.slots[i] if i >= 0 else -1 for i in mapping]))
            graph.replay()
            expected = gpu.model(input_ids=input_ids, adapter_ids=row_slots, use_cache=False).logits
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
