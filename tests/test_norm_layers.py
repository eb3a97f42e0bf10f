"""The fused RMSNorm's CPU side: the reference arithmetic is transformers' own, bad arguments are refused, and a
``NormHook`` falls back to the module's forward for what the kernel does not take and gives the forward back.
The kernel itself: tests/gpu/test_norm_gpu.py."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from helpers import tiny_llama
from punica_hf import MultiLoraModel
from punica_hf.norm_layers import NormHook, fuse_norms
from punica_hf.ops import KernelConfig
from punica_hf.ops import norm as ops_norm


@pytest.mark.parametrize("norm_class", [LlamaRMSNorm, Qwen3RMSNorm])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_reference_is_transformers_rms_norm_to_the_bit(norm_class, dtype):
    torch.manual_seed(0)
    module = norm_class(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        module.weight.normal_()
    x = (torch.randn(5, 7, 96) * 4).to(dtype)
    assert torch.equal(ops_norm.rms_norm_reference(x, module.weight, module.variance_epsilon), module(x))
    assert torch.equal(ops_norm.rms_norm(x, module.weight, module.variance_epsilon), module(x))  # CPU: reference


def test_the_kernel_entry_refuses_what_it_does_not_take():
    x, weight = torch.randn(4, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    for args, message in [
        ((x, weight.float(), 1e-6), "share one dtype"),
        ((x, weight[:32], 1e-6), "weight \\[H\\]"),
        ((x.long(), weight.long(), 1e-6), "share one dtype"),
        ((x, weight, 1e-6), "one CUDA device"),
        ((x, weight, -1.0), "eps"),
        ((x, weight, True), "eps"),
        (("x", weight, 1e-6), "tensors"),
    ]:
        with pytest.raises(ValueError, match=message):
            ops_norm.rms_norm_cuda(*args)


def test_a_norm_hook_runs_the_modules_forward_for_what_the_kernel_does_not_take_and_gives_it_back():
    torch.manual_seed(1)
    module = LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        module.weight.normal_()
    hook = NormHook(module)
    assert module.forward is hook
    x = torch.randn(64, 6)
    for arguments in [(x.t(),), (torch.randn(6, 64, dtype=torch.float64),)]:  # not contiguous; another dtype
        assert torch.equal(module(*arguments), LlamaRMSNorm.forward(module, *arguments))
    hook.remove()
    assert "forward" not in module.__dict__ and not hook.installed
    assert torch.equal(module(x.t()), LlamaRMSNorm.forward(module, x.t()))


def test_nothing_is_fused_on_the_cpu_or_where_the_config_or_backend_says_no():
    model = MultiLoraModel(tiny_llama(), max_adapters=2)
    assert model.fuse_norms() == [] and fuse_norms(model.model) == []
    assert all("forward" not in m.__dict__ for m in model.model.modules() if isinstance(m, LlamaRMSNorm))
    for kernels, backend in ((KernelConfig(fused_norms=False), None), (None, "torch")):
        assert MultiLoraModel(tiny_llama(), max_adapters=2, kernels=kernels, backend=backend).fuse_norms() == []
    with pytest.raises(ValueError, match="fused_norms must be a bool"):
        KernelConfig(fused_norms="yes")
