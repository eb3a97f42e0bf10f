"""bitsandbytes 4-bit and 8-bit bases serve LoRA with PEFT's outputs; base layer kinds are told apart.

Each quantized base is a real bitsandbytes model (``from_pretrained`` with a ``BitsAndBytesConfig``), loaded three
times from one saved float checkpoint: for PEFT, for punica_hf and plain. Quantization is deterministic, so the
three hold the same quantized weights (checked). The oracle for a row is PEFT with that row's adapter active on
the same batch (8-bit layers choose their outlier columns over the whole batch), the plain quantized base for rows
without one.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from architectures import left_padded_batch
from helpers import save_peft_adapter, tiny_llama
from peft import PeftModel
from torch import nn
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
from transformers.pytorch_utils import Conv1D

from punica_hf import MultiLoraModel
from punica_hf.base_layers import check_servable, linear_features, lora_device, lora_dtype

# bitsandbytes quantizes in blocks of 64 input features on the CPU: every projection of this Llama has >= 64.
QUANTIZABLE_LLAMA = dict(hidden_size=64, intermediate_size=128)
ADAPTERS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp": dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj", "o_proj"]),
}
ROW_ADAPTERS = ["attn", None, "mlp", "attn", "mlp"]
# The add-on differs from PEFT's in the last bits only (the scaling is folded into B), but quantized layers round
# their inputs (8-bit ones to int8 through float16, 4-bit ones to bfloat16 on CPUs with AVX512-BF16): now and
# then such a last bit moves an input across a rounding step, a jump of up to ~1e-3 in the logits. In bfloat16
# models PEFT also keeps float32 factors where punica_hf uses bfloat16 ones. Adapters move the logits by ~0.5.
LOGITS_ATOL = {torch.float32: 2e-3, torch.bfloat16: 3e-2}

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@dataclass(frozen=True)
class Case:
    quantization: str  # "nf4" or "fp4" (4-bit), "int8"
    dtype: torch.dtype  # the model's dtype, i.e. its activations'
    compute_dtype: torch.dtype | None = None  # a 4-bit layer's matmul dtype; None: transformers' default, float32
    device: str = "cpu"

    def config(self) -> BitsAndBytesConfig:
        if self.quantization == "int8":
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=self.quantization, bnb_4bit_compute_dtype=self.compute_dtype
        )


CASES = {
    "nf4-float32": Case("nf4", torch.float32),
    "fp4-float32": Case("fp4", torch.float32),
    "int8-float32": Case("int8", torch.float32),
    # A bfloat16 model with the default 4-bit compute dtype, float32: its activations stay bfloat16, and on the
    # GPU the kernels need the factors in the activations' dtype.
    "nf4-bfloat16": Case("nf4", torch.bfloat16),
    "nf4-bfloat16-computing-bfloat16": Case("nf4", torch.bfloat16, compute_dtype=torch.bfloat16),
    "int8-bfloat16": Case("int8", torch.bfloat16),
    "nf4-bfloat16-cuda": Case("nf4", torch.bfloat16, device="cuda"),
    "int8-bfloat16-cuda": Case("int8", torch.bfloat16, device="cuda"),
}


@pytest.fixture(scope="module")
def bitsandbytes():
    """The bitsandbytes module, or a skip saying why its 4-bit and 8-bit layers cannot run on this CPU."""
    try:
        import bitsandbytes
    except ImportError as error:
        pytest.skip(f"bitsandbytes is not installed (pip install -e '.[quantized]'): {error}")
    layers = [
        bitsandbytes.nn.Linear4bit(64, 64, quant_type="nf4", compute_dtype=torch.float32),
        bitsandbytes.nn.Linear8bitLt(64, 64, has_fp16_weights=False),
    ]
    try:
        for layer in layers:
            layer.to("cpu")(torch.ones(2, 64))  # moving to a device quantizes the weight
    except Exception as error:  # bitsandbytes raises various errors for a device it has no backend for
        pytest.skip(f"bitsandbytes {bitsandbytes.__version__} cannot run its layers on the CPU: {error!r}")
    return bitsandbytes


@dataclass
class Setup:
    case: Case
    model: MultiLoraModel
    peft: PeftModel
    plain: nn.Module
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def _case_params(*dtypes: torch.dtype) -> list:
    """The names of the cases in ``dtypes`` as parameters; the GPU ones marked so."""
    return [
        pytest.param(name, marks=[pytest.mark.gpu, _CUDA] if case.device == "cuda" else [], id=name)
        for name, case in CASES.items()
        if case.dtype in dtypes
    ]


@pytest.fixture(scope="module", params=_case_params(torch.float32, torch.bfloat16))
def setup(request, bitsandbytes, tmp_path_factory) -> Setup:
    case = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    float_base = tiny_llama(**QUANTIZABLE_LLAMA)
    paths = {
        name: save_peft_adapter(float_base, folder / name, seed=seed, **config)
        for seed, (name, config) in enumerate(ADAPTERS.items())
    }
    float_base.to(case.dtype).save_pretrained(folder / "base")

    def load_quantized() -> nn.Module:
        return AutoModelForCausalLM.from_pretrained(
            folder / "base", quantization_config=case.config(), dtype=case.dtype, device_map=case.device
        ).eval()

    peft = PeftModel.from_pretrained(load_quantized(), paths["attn"], adapter_name="attn").eval()
    peft.load_adapter(paths["mlp"], adapter_name="mlp")
    model = MultiLoraModel(load_quantized(), max_adapters=2, max_rank=8)
    assert model.load_adapters(paths) == {"attn": 0, "mlp": 1}
    input_ids, attention_mask = left_padded_batch([7, 4, 9, 2, 6], torch.Generator().manual_seed(0))
    return Setup(case, model, peft, load_quantized(), input_ids.to(case.device), attention_mask.to(case.device))


def _oracle(setup: Setup, adapter: str | None) -> nn.Module:
    """PEFT with ``adapter`` active, or the plain quantized base for None."""
    if adapter is None:
        return setup.plain
    setup.peft.set_adapter(adapter)
    return setup.peft


def _rows_by_adapter() -> dict[str | None, list[int]]:
    rows: dict[str | None, list[int]] = {}
    for row, adapter in enumerate(ROW_ADAPTERS):
        rows.setdefault(adapter, []).append(row)
    return rows


@torch.no_grad()
def test_the_bases_are_the_same_bitsandbytes_quantized_model(setup, bitsandbytes):
    four_bit = setup.case.quantization != "int8"
    q_proj = setup.plain.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, bitsandbytes.nn.Linear4bit if four_bit else bitsandbytes.nn.Linear8bitLt)
    assert q_proj.weight.dtype == (torch.uint8 if four_bit else torch.int8)
    batch = {"input_ids": setup.input_ids, "attention_mask": setup.attention_mask}
    plain = setup.plain(**batch).logits
    with setup.peft.disable_adapter():
        assert torch.equal(setup.peft(**batch).logits, plain)
    assert torch.equal(setup.model(**batch).logits, plain)
    assert torch.equal(setup.model(**batch, adapter_ids=[None] * len(ROW_ADAPTERS)).logits, plain)


@torch.no_grad()
def test_mixed_batch_logits_match_peft_row_by_row(setup):
    batch = {"input_ids": setup.input_ids, "attention_mask": setup.attention_mask}
    logits = setup.model(**batch, adapter_ids=ROW_ADAPTERS).logits
    plain = setup.plain(**batch).logits
    real = setup.attention_mask.bool()
    for adapter, rows in _rows_by_adapter().items():
        expected = _oracle(setup, adapter)(**batch).logits
        for row in rows:
            got, want = logits[row][real[row]].float(), expected[row][real[row]].float()
            if adapter is None:  # rows without adapter are the plain base's, exactly
                assert torch.equal(got, want), f"base row {row} differs from the plain quantized base"
                continue
            torch.testing.assert_close(got, want, atol=LOGITS_ATOL[setup.case.dtype], rtol=0)
            # The adapter moves this row far more than the tolerance, so the equality above means something.
            assert (got - plain[row][real[row]].float()).abs().max() > 10 * LOGITS_ATOL[setup.case.dtype]


# In bfloat16 the random tiny model's near-tied logits can legitimately pick another token than PEFT's float32
# add-on: greedy tokens are compared in float32, bfloat16 by its logits above.
@pytest.mark.parametrize("setup", _case_params(torch.float32), indirect=True)
@torch.no_grad()
def test_greedy_tokens_match_peft_row_by_row(setup):
    kwargs = dict(do_sample=False, max_new_tokens=6, attention_mask=setup.attention_mask, pad_token_id=0)
    generated = setup.model.generate(setup.input_ids, adapter_ids=ROW_ADAPTERS, **kwargs)
    for adapter, rows in _rows_by_adapter().items():
        expected = _oracle(setup, adapter).generate(setup.input_ids, **kwargs)
        for row in rows:
            assert torch.equal(generated[row], expected[row]), f"row {row} ({adapter}) differs"


# ------------------------------------------------------------------------------------- base layer kinds, unit


def test_plain_layers_use_their_weights_dtype_device_and_sizes():
    linear = nn.Linear(16, 24, dtype=torch.bfloat16)
    conv1d = Conv1D(24, 16)  # nf=24 outputs, nx=16 inputs, weight stored [16, 24]
    for layer in (linear, conv1d):
        check_servable(layer, "layer")
        assert linear_features(layer) == (16, 24)
        assert lora_dtype(layer, torch.float16) == layer.weight.dtype  # the model's dtype does not matter here
        assert lora_device(layer) == torch.device("cpu")
    assert linear_features(nn.LayerNorm(16)) is None


def test_bitsandbytes_layers_use_the_models_dtype_never_their_storage_dtype(bitsandbytes):
    four_bit = bitsandbytes.nn.Linear4bit(64, 128, quant_type="nf4", compute_dtype=torch.float32).to("cpu")
    eight_bit = bitsandbytes.nn.Linear8bitLt(64, 128, has_fp16_weights=False).to("cpu")
    for layer, storage in ((four_bit, torch.uint8), (eight_bit, torch.int8)):
        assert layer.weight.dtype == storage
        check_servable(layer, "layer")
        assert linear_features(layer) == (64, 128)  # not the packed weight's shape
        # In a bfloat16 model the activations are bfloat16, whatever the 4-bit matmul computes in inside.
        assert lora_dtype(layer, torch.bfloat16) == torch.bfloat16
        assert lora_device(layer) == torch.device("cpu")
        assert layer(torch.ones(3, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


class _Int8Linear(nn.Linear):
    """A quantized linear layer of some other library: an nn.Linear subclass with int8 storage."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=torch.int8), requires_grad=False)


class _TensorSubclass(torch.Tensor):
    """Stands for a torchao quantized tensor or a DTensor: a weight that runs its own matmul."""


def _fp8_linear() -> nn.Linear:
    layer = nn.Linear(16, 16, bias=False)
    layer.weight = nn.Parameter(layer.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
    return layer


def _tensor_subclass_linear() -> nn.Linear:
    layer = nn.Linear(16, 16, bias=False)
    layer.weight = nn.Parameter(layer.weight.detach().as_subclass(_TensorSubclass))
    return layer


# A GPTQ layer is no nn.Linear at all: it holds packed ``qweight`` / ``scales``, named here as auto_gptq names it.
_GPTQQuantLinear = type("QuantLinear", (nn.Module,), {"__module__": "auto_gptq.nn_modules.qlinear.qlinear_cuda"})

REFUSED = {
    "int8_storage": (lambda: _Int8Linear(16, 16), r"_Int8Linear: its weight is stored in torch\.int8"),
    "fp8_storage": (_fp8_linear, r"Linear: its weight is stored in torch\.float8_e4m3fn"),
    "tensor_subclass": (_tensor_subclass_linear, r"its weight is a .*_TensorSubclass"),
    "gptq": (_GPTQQuantLinear, r"auto_gptq\.nn_modules\.qlinear\.qlinear_cuda\.QuantLinear: not an nn\.Linear"),
    "embedding": (lambda: nn.Embedding(10, 16), r"Embedding: not an nn\.Linear"),
}


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_other_quantized_kinds_are_refused_by_name(kind):
    make, message = REFUSED[kind]
    with pytest.raises(ValueError, match=r"^module model\.layers\.0\.q_proj is a .*" + message) as refused:
        check_servable(make(), "model.layers.0.q_proj")
    assert "punica_hf serves LoRA on nn.Linear, Conv1D, bitsandbytes" in str(refused.value)


def test_other_bitsandbytes_layers_are_refused_by_name(bitsandbytes):
    # An nn.Linear subclass with a float weight, but bitsandbytes' own matmul: not ours to add LoRA to.
    with pytest.raises(ValueError, match=r"OutlierAwareLinear: a bitsandbytes layer other than Linear4bit"):
        check_servable(bitsandbytes.nn.OutlierAwareLinear(16, 16), "fc")


def test_offloaded_layers_put_their_lora_on_the_hooks_execution_device():
    from accelerate.hooks import AlignDevicesHook, SequentialHook, add_hook_to_module

    with pytest.raises(ValueError, match=r"^module fc: its weight is on the 'meta' device and no accelerate hook"):
        check_servable(nn.Linear(16, 16, device="meta"), "fc")
    offloaded = nn.Linear(16, 16)
    # Offloading keeps the weight in the hook's map and leaves 'meta' in the module until each forward.
    add_hook_to_module(offloaded, SequentialHook(AlignDevicesHook(execution_device="cpu", offload=True)))
    assert offloaded.weight.device == torch.device("meta")
    check_servable(offloaded, "fc")
    assert lora_device(offloaded) == torch.device("cpu")
