"""The RMSNorm kernel (``ops.rms_norm``) against a float64 reference and transformers' own RMSNorm, and the fused
norms a serving engine runs (``punica_hf.norm_layers``).

Every case draws new inputs (the seed is in the failure message); the memory the kernel's output will take is
filled with NaN first, so a row or element the kernel leaves unwritten shows.
"""

from __future__ import annotations

import secrets

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from helpers import tiny_llama
from punica_hf import MultiLoraModel
from punica_hf.norm_layers import NormHook, fuse_norms
from punica_hf.ops import KernelConfig
from punica_hf.ops import norm as ops_norm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]



def poisoned_run(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel's output, its memory NaN beforehand (the caching allocator hands the freed block back)."""
    poison = torch.full((x.numel() + 64,), float("nan"), dtype=x.dtype, device="cuda")
    del poison
    return ops_norm.rms_norm_cuda(x, weight, eps)


def reference64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return weight.double() * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 4096), (7, 4096), (128, 5120), (3, 5, 128), (33, 100), (2, 8), (0, 4096)])
def test_rms_norm_matches_float64_and_transformers(dtype, shape):
    """Random rows, a zero row and rows whose mean square is near eps (where leaving eps out, or adding it elsewhere,
    shows), against the exact result and against transformers' own RMSNorm."""
    seed = secrets.randbits(31)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    eps = 1e-5
    x = torch.randn(shape, generator=generator, device="cuda") * 3
    rows = x.view(-1, shape[-1])
    if rows.shape[0] >= 3:
        rows[0] = 0
        rows[1:3] *= eps ** 0.5 / 3
    x = x.to(dtype)
    weight = torch.randn(shape[-1], generator=generator, device="cuda").to(dtype)
    out = poisoned_run(x, weight, eps)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    if x.numel() == 0:
        return
    assert torch.isfinite(out).all(), f"seed {seed}: NaN or inf in the output"
    if rows.shape[0] >= 3:
        assert torch.equal(out.view(-1, shape[-1])[0], torch.zeros_like(weight)), f"seed {seed}: zero row"
    assert ops_norm.within_tolerance(out, reference64(x, weight, eps)), f"seed {seed}: off the exact result"
    module = LlamaRMSNorm(shape[-1], eps=eps).to(device="cuda", dtype=dtype)
    module.weight.data.copy_(weight)
    assert ops_norm.within_tolerance(out, module(x)), f"seed {seed}: off transformers' RMSNorm"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_of_an_unaligned_view_and_inside_a_cuda_graph(dtype):
    """A view 2 bytes off 16-byte alignment takes the element path (another summation order than the vector path:
    compared within the tolerance); a captured call replays on new values, bit for bit."""
    seed = secrets.randbits(31)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    storage = torch.randn(8 * 4096 + 1, generator=generator, device="cuda").to(dtype)
    x = storage[1:].view(8, 4096)
    weight = torch.randn(4096, generator=generator, device="cuda").to(dtype)
    assert ops_norm.within_tolerance(poisoned_run(x, weight, 1e-6), reference64(x, weight, 1e-6)), f"seed {seed}"
    assert ops_norm.within_tolerance(poisoned_run(x.clone(), weight, 1e-6), reference64(x, weight, 1e-6))

    static = torch.randn(16, 4096, generator=generator, device="cuda").to(dtype)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops_norm.rms_norm_cuda(static, weight, 1e-6)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops_norm.rms_norm_cuda(static, weight, 1e-6)
    static.copy_(torch.randn(16, 4096, generator=generator, device="cuda").to(dtype))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, ops_norm.rms_norm_cuda(static, weight, 1e-6), rtol=0, atol=0)


def test_rms_norm_refuses_what_it_does_not_take():
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    for bad_x, bad_weight, message in [
        (x, torch.ones(64, device="cuda"), "share one dtype"),
        (x, torch.ones(32, device="cuda", dtype=torch.bfloat16), "weight \\[H\\]"),
        (x.cpu(), torch.ones(64, dtype=torch.bfloat16), "one CUDA device"),
        (x.t(), torch.ones(4, device="cuda", dtype=torch.bfloat16), "contiguous"),
        (x.long(), torch.ones(64, device="cuda", dtype=torch.long), "share one dtype"),
    ]:
        with pytest.raises(ValueError, match=message):
            ops_norm.rms_norm_cuda(bad_x, bad_weight, 1e-6)
    with pytest.raises(ValueError, match="eps"):
        ops_norm.rms_norm_cuda(x, torch.ones(64, device="cuda", dtype=torch.bfloat16), float("nan"))


class OnceRoundedRMSNorm(LlamaRMSNorm):
    """OLMo-2's arithmetic: the weight multiplied in float, one rounding (the kernel rounds twice, as Llama)."""

    def forward(self, hidden_states):
        normalized = hidden_states.float()
        normalized = normalized * torch.rsqrt(normalized.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * normalized).to(hidden_states.dtype)


def test_fuse_norms_hooks_llama_norms_only_and_gives_them_back():
    """Every RMSNorm of a bf16 Llama (two per layer and the final one, random weights) runs the kernel and the
    logits stay those of the model's own norms up to rounding; a norm of other arithmetic under the same attribute
    names (OLMo-2's single rounding) keeps its forward; remove() restores the model's own logits exactly."""
    model = tiny_llama(seed=1, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       intermediate_size=512).to(device="cuda", dtype=torch.bfloat16)
    norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.normal_(1.0, 0.3)
    other = OnceRoundedRMSNorm(256).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        other.weight.normal_(1.0, 0.3)
    model.add_module("extra_norm", other)
    gemma = GemmaRMSNorm(256).to(device="cuda", dtype=torch.bfloat16)
    model.add_module("extra_gemma_norm", gemma)
    input_ids = torch.randint(0, 100, (3, 17), device="cuda")
    with torch.no_grad():
        expected = model(input_ids).logits.float()
    hooks = fuse_norms(model)
    assert len(norms) == 2 * 2 + 1 and {hook.module for hook in hooks} == set(norms)
    assert all(isinstance(m.__dict__.get("forward"), NormHook) for m in norms)
    assert "forward" not in other.__dict__ and "forward" not in gemma.__dict__
    with torch.no_grad():
        fused = model(input_ids).logits.float()
    assert not torch.equal(fused, torch.zeros_like(fused))
    torch.testing.assert_close(fused, expected, rtol=0.05, atol=0.05)
    for hook in hooks:
        hook.remove()
    assert all("forward" not in m.__dict__ for m in norms)
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits.float(), expected)


def test_the_engine_fuses_norms_while_it_runs_unless_told_not_to():
    from punica_hf.serving import Engine, EngineConfig, SamplingParams

    for fused in (True, False):
        base = tiny_llama(seed=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          intermediate_size=512, max_position_embeddings=256).to(device="cuda", dtype=torch.bfloat16)
        model = MultiLoraModel(base, max_adapters=2, kernels=KernelConfig(fused_norms=fused))
        norms = [m for m in base.modules() if isinstance(m, LlamaRMSNorm)]
        config = EngineConfig(max_running=4, max_batch_tokens=64, kv_blocks=16)
        with Engine(model, config=config) as engine:
            hooked = [isinstance(m.__dict__.get("forward"), NormHook) for m in norms]
            result = engine.submit([5, 6, 7, 8], None, SamplingParams(max_new_tokens=4)).result(timeout=120)
            assert len(result.token_ids) == 4
        assert hooked == [fused] * len(norms)
        assert all("forward" not in m.__dict__ for m in norms)  # given back at shutdown
