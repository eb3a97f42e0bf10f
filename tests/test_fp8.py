"""fp8 bases (transformers' ``FineGrainedFP8Config`` layers, ``FP8Linear``) serve LoRA with PEFT's outputs.

An ``FP8Linear`` stores its weight as float8 blocks with one scale per block and multiplies through transformers'
fp8 kernel, which transformers fetches from the Hub (``kernels-community/finegrained-fp8``) and which runs on CUDA
only. The LoRA add-on does not depend on how the base multiplies: on the CPU the base's matmul is replaced by a
float reference of the same math (the weight dequantized block by block), the same for PEFT and for punica_hf, so
the test checks what punica_hf adds on top of an fp8 layer. On a GPU with the kernel (``benchmarks/gpu_session.sh``
puts a carried copy on the path) the real kernel runs under both.

The bases are built from one float model by quantizing each projection block by block (as transformers'
quantizer does), so PEFT and punica_hf see the same fp8 weights.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from architectures import left_padded_batch
from helpers import save_peft_adapter, tiny_llama
from peft import PeftModel
from torch import nn
from torch.nn import functional as F

from punica_hf import MultiLoraModel
from punica_hf.base_layers import check_servable, lora_dtype
from punica_hf.serving import Engine, EngineConfig, SamplingParams

fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = (16, 16)  # the CPU tests' blocks
# The fp8 kernel's blocks are 32 wide at least (a tensor-core dot needs K >= 32): a wider model for the GPU test
KERNEL_BLOCK = (32, 32)
KERNEL_MODEL = dict(hidden_size=64, intermediate_size=128)
E4M3_MAX = 448.0
ADAPTERS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
}
ROW_ADAPTERS = ["attn", None, "mlp", "attn", "mlp"]


def quantized(linear: nn.Linear, block: tuple[int, int] = BLOCK) -> nn.Module:
    """``linear`` as an ``FP8Linear``: float8 e4m3 blocks of ``block``, each scaled to the format's range."""
    out_features, in_features = linear.weight.shape
    layer = fp8.FP8Linear(in_features, out_features, block_size=block, has_bias=linear.bias is not None)
    rows, cols = block
    blocks = linear.weight.detach().float().reshape(out_features // rows, rows, in_features // cols, cols)
    scales = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
    weight = (blocks / scales[:, None, :, None]).to(torch.float8_e4m3fn).reshape(out_features, in_features)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    return layer.to(linear.weight.device)


def fp8_model(float_model: nn.Module, dtype: torch.dtype, device: str, block: tuple[int, int] = BLOCK) -> nn.Module:
    """A copy of ``float_model`` in ``dtype`` on ``device`` whose projections are ``FP8Linear`` layers of
    ``block``."""
    model = copy.deepcopy(float_model).to(device=device, dtype=dtype)
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            parent, child = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), child, quantized(module, block))
    return model.eval()


def reference_fp8_linear(input, weight, weight_scale_inv, block_size=None, bias=None, activation_scale=None,
                         allow_deepgemm=True):
    """transformers' ``fp8_linear`` in float arithmetic: the weight dequantized block by block, then a matmul."""
    rows, cols = block_size
    scales = weight_scale_inv.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    dequantized = weight.float() * scales[: weight.shape[0], : weight.shape[1]]
    return F.linear(input, dequantized.to(input.dtype), bias)


@pytest.fixture
def cpu_fp8_matmul(monkeypatch):
    monkeypatch.setattr(fp8, "fp8_linear", reference_fp8_linear)


def real_fp8_kernel(monkeypatch) -> None:
    """Make transformers' fp8 kernel loadable, or skip: transformers' own loader (the Hub or its cache, through the
    ``kernels`` package), else a ``finegrained_fp8`` package on the path (how the GPU run carries the kernel, made by
    ``benchmarks/carry_packages.py --fp8-kernel``: the GPU machine has no network), handed to transformers as its
    loader would."""
    try:
        fp8.load_finegrained_fp8_kernel()
        return
    except Exception as error:  # no kernels package, no network, no build for this torch: each its own error
        reason = str(error)
    try:
        kernel = importlib.import_module("finegrained_fp8")
    except ImportError:
        pytest.skip(f"transformers' fp8 kernel is unavailable ({reason}) and no finegrained_fp8 package is on the path")
    monkeypatch.setattr(fp8, "_FINEGRAINED_FP8", fp8.FineGrainedFP8(
        matmul=kernel.matmul_2d, batched_matmul=kernel.matmul_batched, grouped_matmul=kernel.matmul_grouped))


def check_against_peft(tmp_path, dtype: torch.dtype, device: str, atol: float, block: tuple[int, int] = BLOCK,
                       **model_config) -> None:
    float_base = tiny_llama(**{"intermediate_size": 64, **model_config})
    paths = {name: save_peft_adapter(float_base, tmp_path / name, seed=seed, **config)
             for seed, (name, config) in enumerate(ADAPTERS.items())}
    peft = PeftModel.from_pretrained(fp8_model(float_base, dtype, device, block), paths["attn"], adapter_name="attn")
    peft.load_adapter(paths["mlp"], adapter_name="mlp")
    plain = fp8_model(float_base, dtype, device, block)
    model = MultiLoraModel(fp8_model(float_base, dtype, device, block), max_adapters=2, max_rank=8)
    assert isinstance(model.model.model.layers[0].self_attn.q_proj, fp8.FP8Linear)
    model.load_adapters(paths)
    input_ids, attention_mask = left_padded_batch([7, 4, 9, 2, 6], torch.Generator().manual_seed(0))
    batch = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        logits = model(**batch, adapter_ids=ROW_ADAPTERS).logits
        base = plain(**batch).logits
        for adapter in ("attn", "mlp", None):
            if adapter is None:
                expected = base
            else:
                peft.set_adapter(adapter)
                expected = peft(**batch).logits
            for row, row_adapter in enumerate(ROW_ADAPTERS):
                if row_adapter != adapter:
                    continue
                got, want = logits[row][real[row]].float(), expected[row][real[row]].float()
                if adapter is None:
                    assert torch.equal(got, want), f"base row {row} differs from the plain fp8 base"
                    continue
                torch.testing.assert_close(got, want, atol=atol, rtol=0)
                assert (got - base[row][real[row]].float()).abs().max() > 10 * atol  # the adapter moves it


def test_lora_on_an_fp8_base_gives_pefts_outputs_row_by_row(tmp_path, cpu_fp8_matmul):
    check_against_peft(tmp_path, torch.float32, "cpu", atol=2e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_lora_on_an_fp8_base_gives_pefts_outputs_through_the_fp8_kernel(tmp_path, monkeypatch):
    real_fp8_kernel(monkeypatch)
    # both run the same fp8 kernel on bfloat16 activations; PEFT keeps float32 factors, punica_hf bfloat16 ones
    check_against_peft(tmp_path, torch.bfloat16, "cuda", atol=5e-2, block=KERNEL_BLOCK, **KERNEL_MODEL)


def test_the_engine_serves_an_fp8_base_as_generate_does(tmp_path, cpu_fp8_matmul):
    float_base = tiny_llama(intermediate_size=64)
    paths = {name: save_peft_adapter(float_base, tmp_path / name, seed=seed, **config)
             for seed, (name, config) in enumerate(ADAPTERS.items())}
    model = MultiLoraModel(fp8_model(float_base, torch.float32, "cpu"), max_adapters=2, max_rank=8)
    model.load_adapters(paths)
    generator = torch.Generator().manual_seed(1)
    plan = [(adapter, torch.randint(1, 100, (length,), generator=generator).tolist(), new_tokens)
            for adapter, length, new_tokens in [("attn", 5, 6), (None, 9, 4), ("mlp", 3, 8), ("mlp", 7, 5)]]

    def generated(adapter, prompt, new_tokens):
        output = model.generate(torch.tensor([prompt]), adapter_ids=[adapter], max_new_tokens=new_tokens,
                                do_sample=False, pad_token_id=0)
        return output[0, len(prompt):].tolist()

    expected = [generated(*request) for request in plan]
    assert expected[0] != generated(None, *plan[0][1:])  # the adapter changes its request's tokens
    with Engine(model, config=EngineConfig(max_running=4)) as engine:
        handles = [engine.submit(prompt, adapter, SamplingParams(max_new_tokens=n)) for adapter, prompt, n in plan]
        assert [list(handle.result(timeout=120).token_ids) for handle in handles] == expected


def test_an_fp8_embedding_first_leaves_the_lora_in_the_activations_dtype(tmp_path, cpu_fp8_matmul):
    """transformers' ``model.dtype`` is its first floating parameter's: float8 when the embedding is an
    ``FP8Embedding``. The LoRA runs in the activations' dtype all the same, with PEFT's outputs."""
    float_base = tiny_llama(intermediate_size=64)
    path = save_peft_adapter(float_base, tmp_path / "attn", seed=1, r=4, target_modules=["q_proj", "v_proj"])

    def with_fp8_embedding() -> nn.Module:
        model = fp8_model(float_base, torch.float32, "cpu")
        table = model.model.embed_tokens.weight.detach()
        embedding = fp8.FP8Embedding(*table.shape)
        scale = table.abs().max() / E4M3_MAX
        embedding.weight = nn.Parameter((table / scale).to(torch.float8_e4m3fn), requires_grad=False)
        embedding.weight_scale = nn.Parameter(scale.reshape(1), requires_grad=False)
        model.model.embed_tokens = embedding
        return model

    assert with_fp8_embedding().dtype == torch.float8_e4m3fn
    peft = PeftModel.from_pretrained(with_fp8_embedding(), path)
    model = MultiLoraModel(with_fp8_embedding(), max_adapters=2, max_rank=8)
    model.load_adapters({"attn": path})
    input_ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids, adapter_ids=["attn"]).logits, peft(input_ids).logits,
                                   atol=2e-4, rtol=0)


def test_an_fp8_layer_runs_its_lora_in_the_models_dtype_never_float8():
    layer = quantized(nn.Linear(32, 16))
    check_servable(layer, "layer")
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert lora_dtype(layer, torch.bfloat16) == torch.bfloat16


def test_a_grouped_fp8_layer_is_refused_by_name():
    grouped = fp8.FP8GroupedLinear(16, 32, n_groups=2, block_size=BLOCK)
    with pytest.raises(ValueError, match=r"^module fc is a .*FP8GroupedLinear: a grouped fp8 layer"):
        check_servable(grouped, "fc")


def test_dora_on_an_fp8_base_is_refused_by_name_and_changes_nothing(tmp_path, cpu_fp8_matmul):
    float_base = tiny_llama(intermediate_size=64)
    path = save_peft_adapter(float_base, tmp_path / "dora", use_dora=True, r=4, target_modules=["q_proj"])
    model = MultiLoraModel(fp8_model(float_base, torch.float32, "cpu"), max_adapters=2, max_rank=8)
    input_ids = torch.tensor([[5, 6, 7]])
    before = model(input_ids).logits
    with pytest.raises(ValueError, match=r"q_proj: DoRA needs the base layer's weight, which an fp8 layer"):
        model.load_adapters({"dora": path})
    assert model.adapters == {}
    assert torch.equal(model(input_ids).logits, before)
