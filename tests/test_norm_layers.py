"""The fused RMSNorm's CPU side: the reference arithmetic is transformers' own, bad arguments are refused, and a
``NormHook`` falls back to the module's forward for what the kernel does not take and gives the forward back.
The kernel itself: tests/gpu/test_norm_gpu.py."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from helpers import tiny_llama
from punica_hf import MultiLoraModel
from punica_hf.norm_layers import NormHook, fuse_norms, probe_rows, same_arithmetic
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


class OnceRounded(LlamaRMSNorm):  # OLMo-2: the weight multiplied in float, one rounding
    def forward(self, hidden_states):
        normalized = hidden_states.float()
        normalized = normalized * torch.rsqrt(normalized.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * normalized).to(hidden_states.dtype)


class OnePlusWeight(LlamaRMSNorm):  # Gemma's scale, under Llama's attribute names
    def forward(self, hidden_states):
        return (1 + self.weight) * LlamaRMSNorm.forward(self, hidden_states) / self.weight


class EpsOutsideTheRoot(LlamaRMSNorm):
    def forward(self, hidden_states):
        normalized = hidden_states.float()
        normalized = normalized / (normalized.pow(2).mean(-1, keepdim=True).sqrt() + self.variance_epsilon)
        return self.weight * normalized.to(hidden_states.dtype)


class Gated(LlamaRMSNorm):
    def forward(self, hidden_states, gate):
        return LlamaRMSNorm.forward(self, hidden_states) * gate


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_only_the_llama_arithmetic_passes_the_probe(dtype):
    """What ``fuse_norms`` checks before it hooks a module (the kernel half needs a GPU: tests/gpu): the module's
    own forward must be the reference bit for bit on the probe rows (random, near eps, zero, large)."""
    torch.manual_seed(2)
    once_is_twice = dtype == torch.float32  # rounding a float32 value to float32 changes nothing
    for norm_class, expected in [(LlamaRMSNorm, True), (Qwen3RMSNorm, True), (OnceRounded, once_is_twice),
                                 (OnePlusWeight, False), (EpsOutsideTheRoot, False), (Gated, False)]:
        module = norm_class(256, eps=1e-5).to(dtype)
        with torch.no_grad():
            module.weight.normal_(1.0, 0.3)
        rows = probe_rows(256, module.variance_epsilon, dtype, torch.device("cpu"))
        assert rows.shape == (19, 256) and not rows[17].any()
        assert same_arithmetic(module, rows) is expected, norm_class.__name__


def test_a_norm_hook_runs_the_modules_forward_for_what_the_kernel_does_not_take_and_gives_it_back():
    torch.manual_seed(1)
    module = LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        module.weight.normal_()
    hook = NormHook(module)
    assert module.forward is hook
    x = torch.randn(64, 6)
    # not contiguous; another dtype; on the CPU (contiguous, the weight's dtype); by keyword
    for args, kwargs in [((x.t(),), {}), ((torch.randn(6, 64, dtype=torch.float64),), {}), ((x.t().contiguous(),), {}),
                         ((), {"hidden_states": x.t()})]:
        assert torch.equal(module(*args, **kwargs), LlamaRMSNorm.forward(module, *args, **kwargs))
    hook.remove()
    assert "forward" not in module.__dict__ and not hook.installed
    assert torch.equal(module(x.t()), LlamaRMSNorm.forward(module, x.t()))


def test_a_copy_of_a_hooked_module_carries_an_inert_hook():
    """The engine that hooked a module cannot take a copy's hook off: a copy (deepcopy, pickle) runs its own
    forward; the original stays hooked."""
    module = LlamaRMSNorm(32)
    hook = NormHook(module)
    for copied in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        copied_hook = copied.__dict__["forward"]
        assert isinstance(copied_hook, NormHook) and copied_hook.module is copied and not copied_hook.installed
        x = torch.randn(3, 32)
        assert torch.equal(copied(x), LlamaRMSNorm.forward(copied, x))
    assert module.forward is hook and hook.installed


def test_nothing_is_fused_on_the_cpu_even_when_asked():
    model = MultiLoraModel(tiny_llama(), max_adapters=2, kernels=KernelConfig(fused_norms=True))
    assert model.fuse_norms() == [] and fuse_norms(model.model) == []
    assert all("forward" not in m.__dict__ for m in model.model.modules() if isinstance(m, LlamaRMSNorm))
    with pytest.raises(ValueError, match="fused_norms must be a bool"):
        KernelConfig(fused_norms="yes")


def test_the_model_fuses_only_where_its_kernel_config_and_backend_say_so(monkeypatch):
    import punica_hf.model as model_module

    asked = []
    monkeypatch.setattr(model_module, "fuse_norms", lambda hf_model: asked.append(hf_model) or ["hooks"])
    for kernels, backend, expected in [(KernelConfig(fused_norms=True), None, True),
                                       (KernelConfig(fused_norms=True), "cuda", True),
                                       (KernelConfig(fused_norms=True), "torch", False),
                                       (KernelConfig(fused_norms=False), None, False),
                                       (None, None, False)]:  # off by default
        asked.clear()
        model = MultiLoraModel(tiny_llama(), max_adapters=2, kernels=kernels, backend=backend)
        assert model.fuse_norms() == (["hooks"] if expected else []) and asked == ([model.model] if expected else [])
