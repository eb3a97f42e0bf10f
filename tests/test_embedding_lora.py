"""LoRA on the input embeddings and on the output layer (``embed_tokens``, ``lm_head``), tied or not, equals PEFT.

PEFT adapters with such targets are saved by PEFT in the test (random non-zero factors) and read from their folders.
A mixed batch (embedding-LoRA rows, lm_head-LoRA rows, plain LoRA rows and base rows) through one
``MultiLoraModel`` with fewer slots than adapters equals PEFT's ``PeftModel``, one adapter at a time, row by row:
logits and ``generate()``. The engine gives the tokens of ``generate()``. What stays out is refused by name.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from architectures import ARCHITECTURES, left_padded_batch
from helpers import PeftOracleSetup, assert_state_unchanged, capture_state, save_peft_adapter, tiny_llama
from peft import PeftModel
from safetensors.torch import load_file, save_file

from punica_hf import MultiLoraModel, vocab_layers
from punica_hf.formats import convert_adapter
from punica_hf.ops import TorchLoraBackend, build_segments
from punica_hf.ops.torch_ops import lora_add, pack_factors
from punica_hf.serving import Engine, EngineConfig, SamplingParams
from punica_hf.vocab_layers import embedding_delta, linear_delta

ATOL = 2e-5
VOCAB = 96  # a multiple of 8, as the CUDA kernels take it (tests/gpu runs the same adapters)
# name: (LoraConfig kwargs, save_pretrained kwargs)
ADAPTERS = {
    "embed": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"]), {}),
    "head": (dict(r=8, lora_alpha=4, target_modules=["lm_head", "v_proj"]), {"save_embedding_layers": False}),
    "both": (dict(r=2, lora_alpha=4, use_rslora=True, target_modules=["embed_tokens", "lm_head", "down_proj"]), {}),
    "plain": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]), {}),
}
MAX_SLOTS = 3  # fewer than the adapters: the two batches below evict one another's adapters
BATCHES = [["embed", "head", None, "plain", "embed"], ["both", "head", "plain", None, "both"]]
LENGTHS = [7, 4, 9, 2, 6]


def make_base(tied: bool) -> torch.nn.Module:
    base = tiny_llama(vocab_size=VOCAB, tie_word_embeddings=tied, max_position_embeddings=256)
    assert (base.lm_head.weight is base.model.embed_tokens.weight) == tied
    base.generation_config.eos_token_id = None  # every row runs to max_new_tokens
    return base


def save_adapters(base: torch.nn.Module, root: Path) -> dict[str, Path]:
    return {
        name: save_peft_adapter(base, root / name, seed=seed, save_kwargs=save_kwargs, **config)
        for seed, (name, (config, save_kwargs)) in enumerate(ADAPTERS.items(), start=1)
    }


def left_padded(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = torch.randint(2, VOCAB, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(seed))
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        attention_mask[row, -length:] = 1
        input_ids[row, :-length] = 0
    return input_ids, attention_mask


Setup = PeftOracleSetup  # the model under test beside PEFT's, and PEFT's model for a row


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def setup(request, tmp_path_factory) -> Setup:
    base = make_base(tied=request.param)
    paths = save_adapters(base, tmp_path_factory.mktemp("adapters"))
    names = list(paths)
    peft = PeftModel.from_pretrained(copy.deepcopy(base), paths[names[0]], adapter_name=names[0]).eval()
    for name in names[1:]:
        peft.load_adapter(paths[name], adapter_name=name)
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=MAX_SLOTS, max_rank=8)
    model.load_adapters(paths)
    return Setup(model, base, peft, paths)


@pytest.mark.parametrize("batch", [0, 1])
@torch.no_grad()
def test_mixed_batch_logits_match_peft_row_by_row(setup, batch):
    rows = BATCHES[batch]
    input_ids, attention_mask = left_padded(LENGTHS, seed=batch)
    logits, base_logits, real = setup.mixed_logits(input_ids, attention_mask, rows, ATOL)
    for row, adapter in enumerate(rows):
        if adapter is not None:  # the adapter really changes this row
            assert (logits[row][real[row]] - base_logits[row][real[row]]).abs().max() > 1e-3


GENERATION_MODES = {
    "greedy": dict(do_sample=False),
    "greedy_static_cache": dict(do_sample=False, cache_implementation="static"),
    "beam_search": dict(do_sample=False, num_beams=3, num_return_sequences=2),
}


@pytest.mark.parametrize("mode", sorted(GENERATION_MODES))
@torch.no_grad()
def test_generate_matches_peft_row_by_row(setup, mode):
    kwargs = dict(GENERATION_MODES[mode], max_new_tokens=6, pad_token_id=0)
    expand = kwargs.get("num_return_sequences", 1)
    for batch, rows in enumerate(BATCHES):
        input_ids, attention_mask = left_padded(LENGTHS, seed=batch)
        generated = setup.model.generate(input_ids, attention_mask=attention_mask, adapter_ids=rows, **kwargs)
        for row, adapter in enumerate(rows):
            expected = setup.oracle(adapter).generate(input_ids, attention_mask=attention_mask, **kwargs)
            out_rows = slice(row * expand, (row + 1) * expand)
            assert torch.equal(generated[out_rows], expected[out_rows]), f"row {row} ({adapter}) differs"


@pytest.mark.parametrize(
    "logits_to_keep, positions",
    [
        pytest.param(1, [8], id="last"),
        pytest.param(3, [6, 7, 8], id="last-3"),
        pytest.param(torch.tensor([0, 4, 8]), [0, 4, 8], id="positions"),
    ],
)
@torch.no_grad()
def test_output_layer_lora_follows_the_positions_the_model_keeps(setup, logits_to_keep, positions):
    """transformers runs lm_head on the kept positions only (generate: the last; the engine: each sequence's last):
    each kept position gets its own row's adapter."""
    rows = BATCHES[1]
    input_ids, attention_mask = left_padded(LENGTHS, seed=1)
    full = setup.model(input_ids, attention_mask=attention_mask, adapter_ids=rows).logits
    kept = setup.model(input_ids, attention_mask=attention_mask, adapter_ids=rows, logits_to_keep=logits_to_keep).logits
    torch.testing.assert_close(kept, full[:, positions], atol=1e-6, rtol=0)


@torch.no_grad()
def test_engine_tokens_equal_generate_with_embedding_and_output_layer_adapters(tmp_path):
    base = make_base(tied=True)
    model = MultiLoraModel(base, max_adapters=MAX_SLOTS, max_rank=8)
    model.load_adapters(save_adapters(base, tmp_path))
    prompts = [left_padded([length], seed=seed)[0][0].tolist() for seed, length in enumerate([5, 9, 3, 12, 4, 7])]
    plan = list(zip(["both", "plain", "embed", None, "head", "both"], prompts, [6, 3, 8, 5, 4, 7]))

    def generated(adapter: str | None, prompt: list[int], new_tokens: int) -> list[int]:
        output = model.generate(torch.tensor([prompt]), adapter_ids=[adapter], max_new_tokens=new_tokens,
                                do_sample=False, pad_token_id=0)
        return output[0, len(prompt):].tolist()

    expected = [generated(adapter, prompt, n) for adapter, prompt, n in plan]
    for adapter, prompt, n in plan:  # each embedding or lm_head adapter changes its request's tokens
        if adapter in ("both", "embed", "head"):
            assert generated(None, prompt, n) != generated(adapter, prompt, n), adapter
    with Engine(model, config=EngineConfig(max_running=4)) as engine:
        handles = [engine.submit(prompt, adapter, SamplingParams(max_new_tokens=n)) for adapter, prompt, n in plan]
        completions = [handle.result(timeout=120) for handle in handles]
    assert [list(completion.token_ids) for completion in completions] == expected


@torch.no_grad()
def test_a_converted_adapter_equals_its_peft_folder(setup, tmp_path):
    converted = convert_adapter(setup.paths["both"], tmp_path / "both.safetensors")
    model = MultiLoraModel(copy.deepcopy(setup.base), max_adapters=2, max_rank=8)
    model.load_adapters({"folder": setup.paths["both"], "converted": converted})
    input_ids, attention_mask = left_padded(LENGTHS[:2])
    folder = model(input_ids, attention_mask=attention_mask, adapter_ids=["folder"] * 2).logits
    from_file = model(input_ids, attention_mask=attention_mask, adapter_ids=["converted"] * 2).logits
    torch.testing.assert_close(from_file, folder, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------ refused
@pytest.fixture
def unchanged(setup):
    """A model with adapters in use, whose state is checked unchanged after each refusal."""
    model = MultiLoraModel(copy.deepcopy(setup.base), max_adapters=2, max_rank=8)
    model.load_adapters({name: setup.paths[name] for name in ("both", "plain")})
    input_ids, _ = left_padded([5, 5])
    before = capture_state(model, input_ids, ["both", "plain"])
    yield model
    assert_state_unchanged(model, before)


def test_an_adapter_of_a_resized_vocabulary_is_refused(unchanged, setup, tmp_path):
    resized = copy.deepcopy(setup.base)
    resized.resize_token_embeddings(VOCAB + 8)
    path = save_peft_adapter(resized, tmp_path / "resized", r=4, target_modules=["embed_tokens", "lm_head"])
    problem = r"\.weight is \[104, 32\] but the base model's is \[96, 32\]: the adapter was trained on a resized vocab"
    with pytest.raises(ValueError, match=problem):
        unchanged.load_adapters({"x": path})


def _with_changed_base_copy(path: Path) -> Path:
    weights_file = path / "adapter_model.safetensors"
    tensors = load_file(weights_file)
    tensors["base_model.model.model.embed_tokens.base_layer.weight"][5] += 1.0  # a "retrained" token row
    save_file(tensors, weights_file, metadata={"format": "pt"})
    return path


def test_an_adapter_whose_base_weight_copy_differs_from_the_model_is_refused(unchanged, setup, tmp_path):
    """PEFT loads the copy of the embedding it saved over the base weight: serving cannot, so it refuses."""
    path = _with_changed_base_copy(save_peft_adapter(setup.base, tmp_path / "x", r=4, target_modules=["embed_tokens"]))
    with pytest.raises(ValueError, match=r"its copy of model\.embed_tokens\.weight differs from the base model's"):
        unchanged.load_adapters({"x": path})
    converted = convert_adapter(path, tmp_path / "x.safetensors")  # the copy travels in the converted file
    with pytest.raises(ValueError, match=r"its copy of model\.embed_tokens\.weight differs from the base model's"):
        unchanged.load_adapters({"x": converted})


@pytest.mark.parametrize("targets", [["embed_tokens", "lm_head", "q_proj"], ["embed_tokens", "v_proj"]],
                         ids=["lm_head-listed", "lm_head-unlisted"])
@torch.no_grad()
def test_lora_tied_by_ensure_weight_tying_equals_peft(tmp_path, targets):
    """On tied embeddings with ensure_weight_tying=True, PEFT drops lm_head from the saved targets and ties its
    LoRA to the embedding's (listed or not): served from the lm_head factors the checkpoint holds."""
    base = make_base(tied=True)
    path = save_peft_adapter(base, tmp_path / "tied", r=4, lora_alpha=8, target_modules=targets,
                             ensure_weight_tying=True)
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    model.load_adapters({"tied": path})
    assert "lm_head" in model._injection.hooks
    input_ids, attention_mask = left_padded(LENGTHS[:3], seed=4)
    logits = model(input_ids, attention_mask=attention_mask, adapter_ids=["tied", None, "tied"]).logits
    peft = PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
    expected = peft(input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    # PEFT's tied lm_head factors are transposed views, which its GEMM rounds otherwise: by up to 5e-5 on logits of
    # magnitude 200 here (1e-7 of their scale), where contiguous copies of its factors give ours to the bit
    for row in (0, 2):
        torch.testing.assert_close(logits[row][real[row]], expected[row][real[row]], atol=1e-4, rtol=0)

    weights_file = path / "adapter_model.safetensors"
    save_file({k: v for k, v in load_file(weights_file).items() if ".lm_head." not in k}, weights_file)
    with pytest.raises(ValueError, match=r"ties lm_head's LoRA to model\.embed_tokens's \(ensure_weight_tying=True\) "
                                         "but it holds no lm_head weights"):
        MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8).load_adapters({"tied": path})


@torch.no_grad()
def test_ensure_weight_tying_on_an_embedding_peft_does_not_tie_by_its_name_equals_peft(tmp_path):
    """PEFT ties lm_head's LoRA only when target_modules names an embedding it knows by name ("embed_tokens",
    "lm_head"): on GPT-2, "wte" leaves lm_head untied (PEFT warns), and the checkpoint holds no lm_head weights. It
    used to be refused for missing them."""
    torch.manual_seed(0)
    base = ARCHITECTURES["gpt2"].make_model().eval()
    assert base.lm_head.weight is base.transformer.wte.weight
    path = save_peft_adapter(base, tmp_path / "x", seed=3, r=3, lora_alpha=8, target_modules=["wte", "c_fc"],
                             ensure_weight_tying=True, fan_in_fan_out=True)
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=1, max_rank=8)
    model.load_adapters({"x": path})
    assert "lm_head" not in model._injection.hooks
    input_ids, attention_mask = left_padded_batch([6, 3, 5])
    logits = model(input_ids, attention_mask=attention_mask, adapter_ids=["x", None, "x"]).logits
    expected = PeftModel.from_pretrained(copy.deepcopy(base), path).eval()(input_ids, attention_mask=attention_mask)
    real = attention_mask.bool()
    for row in (0, 2):
        torch.testing.assert_close(logits[row][real[row]], expected.logits[row][real[row]], atol=ATOL, rtol=0)


def test_an_embedding_with_max_norm_is_refused(setup):
    """PEFT's lookup would renormalise the LoRA factors' rows in place."""
    model = MultiLoraModel(copy.deepcopy(setup.base), max_adapters=2, max_rank=8)
    model.model.model.embed_tokens.max_norm = 1.0
    with pytest.raises(ValueError, match="LoRA on embedding model.embed_tokens is not supported: it has max_norm set"):
        model.load_adapters({"x": setup.paths["embed"]})
    assert model.adapters == {}


def test_trainable_token_indices_stay_refused(setup, tmp_path):
    path = save_peft_adapter(setup.base, tmp_path / "x", r=4, target_modules=["q_proj"],
                             trainable_token_indices=[3, 5])
    model = MultiLoraModel(copy.deepcopy(setup.base), max_adapters=2, max_rank=8)
    with pytest.raises(ValueError, match="trainable_token_indices is not supported"):
        model.load_adapters({"x": path})


# ------------------------------------------------------------------------------------------------ the ops
def test_the_fixed_shape_ops_equal_the_reference_lora_add():
    """``embedding_delta`` (LoRA on one-hot token ids) and ``linear_delta`` (the output layer's path where the CUDA
    kernels do not take its sizes) equal ``torch_ops.lora_add``: tokens of four slots, one of rank 0 here, and base
    tokens; the pool's free space holds NaN, which must never reach a result."""
    generator = torch.Generator().manual_seed(0)
    vocab, out_features, max_rank, ranks = 13, 11, 4, [3, 0, 4, 1]
    factors, gaps = [], []
    for rank in ranks:
        rank = max(rank, 1)  # a rank-0 slot's offsets are never read; give it a factor to keep the layout simple
        factors += [torch.randn(rank, vocab, generator=generator), torch.randn(rank, out_features, generator=generator)]
        gaps += [7, 3]
    pool, offsets = pack_factors(factors, gaps, fill=float("nan"))
    a_offsets, b_offsets = torch.tensor(offsets[0::2]), torch.tensor(offsets[1::2])
    lora_ranks = torch.tensor(ranks, dtype=torch.int32)
    token_slots = torch.tensor([2, -1, 0, 1, 3, 0, 2, -1, 3], dtype=torch.int32)
    segments = build_segments(token_slots, len(ranks))
    token_ids = torch.randint(0, vocab, (token_slots.shape[0],), generator=generator)
    x = torch.randn(token_slots.shape[0], vocab, generator=generator)
    tables = (pool, a_offsets, b_offsets, lora_ranks)
    for name, inputs, delta in [
        ("embedding", torch.nn.functional.one_hot(token_ids, vocab).float(),
         embedding_delta(token_ids, token_slots, *tables, vocab, out_features, max_rank)),
        ("linear", x, linear_delta(x, token_slots, *tables, out_features, max_rank)),
    ]:
        expected = torch.zeros(token_slots.shape[0], out_features)
        lora_add(expected, inputs, pool, a_offsets, b_offsets, lora_ranks, segments, max_rank)
        torch.testing.assert_close(delta, expected, atol=1e-5, rtol=1e-5, msg=name)
        assert (expected[token_slots == 0] != 0).all() and (expected[token_slots < 0] == 0).all()


class _BackendWithoutKernelSizes(TorchLoraBackend):
    """The PyTorch ops under another name: the output layer's hook takes it for kernels that refuse its sizes."""

    name = "no-kernel-sizes"


@torch.no_grad()
def test_an_output_layer_the_kernels_cannot_take_runs_the_fixed_shape_ops_and_equals_peft(setup, monkeypatch):
    calls = []
    monkeypatch.setattr(vocab_layers, "linear_delta", lambda *args: calls.append(1) or linear_delta(*args))
    model = MultiLoraModel(copy.deepcopy(setup.base), max_adapters=MAX_SLOTS, max_rank=8)
    model.load_adapters({name: setup.paths[name] for name in ("head", "both")})
    model._injection.context._backends[torch.device("cpu")] = _BackendWithoutKernelSizes()
    rows = ["head", None, "both", "head"]
    input_ids, attention_mask = left_padded(LENGTHS[:4], seed=2)
    logits = model(input_ids, attention_mask=attention_mask, adapter_ids=rows, logits_to_keep=1).logits
    assert calls
    for row, adapter in enumerate(rows):
        expected = setup.oracle(adapter)(input_ids, attention_mask=attention_mask).logits
        torch.testing.assert_close(logits[row, -1], expected[row, -1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@torch.no_grad()
def test_vocabulary_layers_of_each_architecture_match_peft(arch, tmp_path):
    """GPT-2's ``wte`` and the others' ``embed_tokens``, with ``lm_head`` (tied in GPT-2 and OPT), in a batch with a
    plain adapter's rows and base rows."""
    torch.manual_seed(0)
    base = ARCHITECTURES[arch].make_model().eval()
    vocab_targets = ["wte", "lm_head"] if arch == "gpt2" else ["embed_tokens", "lm_head"]
    paths = {
        "vocab": save_peft_adapter(base, tmp_path / "vocab", seed=1, r=4, lora_alpha=8, target_modules=vocab_targets),
        "plain": save_peft_adapter(base, tmp_path / "plain", seed=2, r=4, lora_alpha=8,
                                   target_modules=ARCHITECTURES[arch].attention_targets[:1],
                                   fan_in_fan_out=arch == "gpt2"),
    }
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    model.load_adapters(paths)
    input_ids, attention_mask = left_padded_batch([6, 3, 5, 4])
    rows = ["vocab", "plain", None, "vocab"]
    logits = model(input_ids, attention_mask=attention_mask, adapter_ids=rows).logits
    real = attention_mask.bool()
    for adapter in ("vocab", "plain", None):
        oracle = base if adapter is None else PeftModel.from_pretrained(copy.deepcopy(base), paths[adapter]).eval()
        expected = oracle(input_ids, attention_mask=attention_mask).logits
        for row in (r for r, a in enumerate(rows) if a == adapter):
            torch.testing.assert_close(logits[row][real[row]], expected[row][real[row]], atol=ATOL, rtol=0)
            if adapter is not None:  # the adapter really changes this row
                assert (logits[row] - base(input_ids, attention_mask=attention_mask).logits[row]).abs().max() > 1e-3


@torch.no_grad()
def test_lora_on_gpt2_positions_gives_each_row_its_adapters_update(tmp_path):
    """GPT-2 looks its position embeddings up with ids ``[1, T]`` shared by every row: a mixed batch used to fail
    ("a LoRA embedding got 7 tokens but the batch's adapter mapping has 21"). Each row gets its own adapter's update
    on its positions, as PEFT gives it with that adapter alone."""
    torch.manual_seed(0)
    base = ARCHITECTURES["gpt2"].make_model().eval()
    paths = {name: save_peft_adapter(base, tmp_path / name, seed=seed, r=4, lora_alpha=8, fan_in_fan_out=True,
                                     target_modules=targets)
             for name, seed, targets in (("pos", 1, ["wpe", "c_attn"]), ("pos_only", 2, ["wpe"]))}
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    model.load_adapters(paths)
    input_ids = torch.randint(3, 90, (3, 7), generator=torch.Generator().manual_seed(4))
    rows = ["pos", None, "pos_only"]
    logits = model(input_ids, adapter_ids=rows).logits
    for row, adapter in enumerate(rows):
        oracle = base if adapter is None else PeftModel.from_pretrained(copy.deepcopy(base), paths[adapter]).eval()
        torch.testing.assert_close(logits[row], oracle(input_ids).logits[row], atol=ATOL, rtol=0)
    assert (logits[2] - base(input_ids).logits[2]).abs().max() > 1e-3  # the positions' LoRA alone changes it


def test_lora_on_opts_learned_positions_is_refused_by_name(tmp_path):
    """OPT's position embedding is called with the attention mask and makes the ids itself: a hook given the mask
    as ids computed nonsense (PEFT's own generate() fails on it)."""
    base = ARCHITECTURES["opt"].make_model().eval()
    path = save_peft_adapter(base, tmp_path / "x", seed=1, r=4, lora_alpha=8, target_modules=["embed_positions"])
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=1, max_rank=8)
    with pytest.raises(ValueError, match=r"LoRA on embedding model\.decoder\.embed_positions is not supported: "
                                         r"OPTLearnedPositionalEmbedding is called with \(attention_mask, "):
        model.load_adapters({"x": path})
    assert model.adapters == {}
