"""MultiLoraModel over a model split by transformers' tensor parallelism: 2 ranks, gloo, CPU.

One ``torchrun`` run of ``tp_worker.py`` (module fixture) loads each tiny model split over 2 ranks and whole, runs
the same calls on both, and writes what each rank saw; the tests here judge it. Models: "even" (every split even,
q/k/v and gate/up grouped at their local widths) and "odd" (intermediate size 67: gate/up/down split 34 + 33, widths
the grouping does not take), and "qwen2" (biases on q/k/v: column-split layers with a bias).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from architectures import ARCHITECTURES
from helpers import save_peft_adapter, tiny_llama
from punica_hf.tensor_parallel import _share, _style_problem
from two_ranks import run_two_ranks
from vector_adapters import save_vector_adapter

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without torch.distributed")

WORKER = Path(__file__).with_name("tp_worker.py")
RUN_TIMEOUT_S = 240
TOLERANCE = 1e-5  # float32; the split model sums the same products in another order


def _save_models_and_adapters(root: Path) -> None:
    models = {"even": tiny_llama(seed=0), "odd": tiny_llama(seed=1, hidden_size=40, intermediate_size=67)}
    torch.manual_seed(2)
    models["qwen2"] = ARCHITECTURES["qwen2"].make_model().eval()
    with torch.no_grad():
        for name, parameter in models["qwen2"].named_parameters():
            if name.endswith("bias"):
                parameter.normal_()  # non-zero, so a bias added once per rank (not once) would show
    for name, model in models.items():
        model.save_pretrained(root / "models" / name)
    even, odd = root / "adapters" / "even", root / "adapters" / "odd"
    base = models["even"]
    save_peft_adapter(base, even / "attn", r=4, target_modules=["q_proj", "v_proj", "o_proj"], seed=1)
    save_peft_adapter(base, even / "mlp", r=8, target_modules=["gate_proj", "down_proj"], seed=2)
    save_peft_adapter(base, even / "wide", r=16, lora_alpha=8, use_rslora=True, target_modules="all-linear", seed=3)
    save_peft_adapter(base, even / "head", r=4, target_modules=["lm_head"], seed=4)
    save_peft_adapter(base, even / "embed", r=4, target_modules=["embed_tokens"], seed=5)
    save_peft_adapter(models["odd"], odd / "attn", r=4, target_modules=["q_proj", "k_proj", "o_proj"], seed=6)
    save_peft_adapter(models["odd"], odd / "mlp", r=8, target_modules=["gate_proj", "up_proj", "down_proj"], seed=7)
    qwen2 = root / "adapters" / "qwen2"
    save_peft_adapter(models["qwen2"], qwen2 / "attn", r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      seed=8)
    save_peft_adapter(models["qwen2"], qwen2 / "mlp", r=8, target_modules=["gate_proj", "up_proj", "down_proj"], seed=9)
    # DoRA, LoRA bias and bias="all" on column-split layers with biases (q/k/v), DoRA on a row-split one (refused)
    column_split = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
    save_vector_adapter(models["qwen2"], qwen2 / "dora", 10, r=4, use_dora=True, target_modules=column_split)
    save_vector_adapter(models["qwen2"], qwen2 / "lora_bias", 11, r=4, lora_bias=True, target_modules=column_split[:3])
    save_vector_adapter(base, even / "dora_o", 12, r=4, use_dora=True, target_modules=["q_proj", "o_proj"])
    save_vector_adapter(models["qwen2"], qwen2 / "bias_all", 13, r=4, bias="all", target_modules=["q_proj"])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """What each of the 2 ranks saw (tp_worker.py's JSON), after one torchrun run."""
    root = tmp_path_factory.mktemp("tp")
    _save_models_and_adapters(root)
    return run_two_ranks(WORKER, root, RUN_TIMEOUT_S)


def _section(ranks: list[dict], name: str) -> list[dict]:
    for rank, results in enumerate(ranks):
        assert "error" not in results[name], f"rank {rank}, {name}:\n{results[name]['error']}"
    return [results[name] for results in ranks]


@pytest.mark.parametrize("model", ["even", "odd", "qwen2"])
def test_logits_equal_the_unsplit_model(ranks, model):
    for seen in _section(ranks, model):
        assert seen["lora_effect"] > 1e-2  # the adapters do change the output: the comparison means something
        assert seen["logits_difference"] < TOLERANCE
        assert seen["per_token_difference"] < TOLERANCE


@pytest.mark.parametrize("model", ["even", "odd", "qwen2"])
def test_greedy_generation_equals_the_unsplit_model_on_every_rank(ranks, model):
    seen = _section(ranks, model)
    assert seen[0]["tokens"] == seen[1]["tokens"]
    assert seen[0]["tokens"] == seen[0]["expected_tokens"]
    assert seen[0]["tokens"] != seen[0]["base_tokens"]


def test_local_widths_and_grouping(ranks):
    even, odd = (_section(ranks, name) for name in ("even", "odd"))
    for rank, (even_seen, odd_seen) in enumerate(zip(even, odd)):
        widths = even_seen["local_widths"]
        assert widths["model.layers.0.self_attn.q_proj"] == [32, 16]  # column: whole input, half the output
        assert widths["model.layers.0.self_attn.k_proj"] == [32, 8]
        assert widths["model.layers.0.self_attn.o_proj"] == [16, 32]  # row: half the input, whole output
        mlp = odd_seen["local_widths"]
        assert mlp["model.layers.0.mlp.gate_proj"] == [40, [34, 33][rank]]  # uneven, as transformers splits
        assert mlp["model.layers.0.mlp.down_proj"] == [[34, 33][rank], 40]
        assert "model.layers.0.self_attn.k_proj" in even_seen["grouped_modules"]
        assert "model.layers.0.mlp.up_proj" in even_seen["grouped_modules"]
        assert odd_seen["grouped_modules"] == [
            name for name in odd_seen["grouped_modules"] if "mlp" not in name
        ]


@pytest.mark.parametrize("model", ["even", "odd", "qwen2"])
def test_unwrap_gives_the_split_model_back(ranks, model):
    for seen in _section(ranks, model):
        assert seen["unwrapped_forwards_restored"]
        assert seen["unwrapped_difference"] == 0.0


def test_factor_bytes_per_rank_against_the_unsplit_adapter(ranks):
    """Each rank holds A whole and half of B on column-split layers, half of A and B whole on row-split ones."""
    # "even": hidden 32, k/v out 16, intermediate 64, 2 layers; adapters attn (r 4: q v o), mlp (r 8: gate down),
    # wide (r 16, all seven). Per module (rank, in, out, split side); float32.
    q, k, v, o = (32, 32, "out"), (32, 16, "out"), (32, 16, "out"), (32, 32, "in")
    gate, up, down = (32, 64, "out"), (32, 64, "out"), (64, 32, "in")
    modules = [(4, *q), (4, *v), (4, *o), (8, *gate), (8, *down)] + [(16, *m) for m in (q, k, v, o, gate, up, down)]
    unsplit = 2 * 4 * sum(r * (i + out) for r, i, out, _ in modules)
    per_rank = 2 * 4 * sum(r * (i + out // 2 if side == "out" else i // 2 + out) for r, i, out, side in modules)
    for seen in _section(ranks, "even"):
        assert seen["factor_bytes"] == [per_rank, unsplit]
        assert seen["whole_factor_bytes"] == [unsplit, unsplit]


def test_more_adapters_than_slots(ranks):
    for seen in _section(ranks, "eviction"):
        assert seen["evictions"] >= 2
        assert max(seen["eviction_differences"]) < TOLERANCE


def test_an_unload_while_a_request_holds_the_adapter(ranks):
    for seen in _section(ranks, "eviction"):
        assert seen["unloaded_while_held"]
        assert seen["held_tokens"] == seen["held_expected_tokens"]
        assert seen["resident_after_release"] == 1  # the unloaded adapter's memory freed once the lease ended


def test_refusals_name_the_reason_and_change_nothing(ranks):
    for seen in _section(ranks, "eviction"):
        refusals = seen["refusals"]
        assert "inference only" in refusals["gradients"] and "torch.no_grad()" in refusals["gradients"]
        assert "lm_head" in refusals["lm_head"] and "output layer" in refusals["lm_head"]
        assert "embed_tokens" in refusals["embedding"] and "embedding" in refusals["embedding"]
        assert "'misfit'" in refusals["misfit"] and "does not fit the base model" in refusals["misfit"]
        misfits = {  # the unsplit widths, whichever module of the "odd" adapter is checked first
            "gate_proj": "takes lora_A [r, 32] and lora_B [64, r], the adapter has [8, 40] and [67, 8]",
            "up_proj": "takes lora_A [r, 32] and lora_B [64, r], the adapter has [8, 40] and [67, 8]",
            "down_proj": "takes lora_A [r, 64] and lora_B [32, r], the adapter has [8, 67] and [40, 8]",
        }
        assert any(f"{leaf} {text}" in refusals["misfit"] for leaf, text in misfits.items()), refusals["misfit"]
        assert seen["adapters_unchanged"] and seen["stats_unchanged"]
        assert seen["after_refusals_difference"] < TOLERANCE
    for seen in _section(ranks, "packed"):
        assert "gate_proj" in seen["packed"] and "packed" in seen["packed"]
        assert seen["packed_adapters"] == {}


def test_dora_and_lora_bias_on_column_split_layers_and_dora_refused_on_row_split_ones(ranks):
    for seen in _section(ranks, "vectors"):
        assert seen["lora_effect"] > 1e-2
        assert seen["logits_difference"] < TOLERANCE and seen["per_token_difference"] < TOLERANCE
        assert seen["tokens"] == seen["expected_tokens"]
        assert "o_proj" in seen["row_split"] and "column-split layers only" in seen["row_split"]
        assert seen["row_split_adapters"] == {}


def test_a_load_interrupted_while_hooking_split_layers_leaves_them_as_they_were(ranks):
    for seen in _section(ranks, "interrupted"):
        assert seen["error_message"] == "interrupted"
        assert seen["adapters"] == {}
        assert seen["forwards_restored"]
        assert seen["logits_difference"] == 0.0


def test_styles_refused_by_kind():
    assert _style_problem("colwise") is None and _style_problem("rowwise") is None
    assert "MoE experts" in _style_problem("moe_tp_experts")
    assert "gathered across ranks" in _style_problem("colwise_gather_output")
    assert "packed" in _style_problem("packed_rowwise")
    assert "not one LoRA is served on" in _style_problem("sequence_parallel")


def test_shares_split_as_torch_chunk_does():
    for size in (1, 5, 64, 67):
        for parts in (2, 3, 4, 8):
            chunks = torch.arange(size).chunk(parts)
            for index in range(parts):
                share = _share(size, parts, index)
                expected = chunks[index].tolist() if index < len(chunks) else []
                assert list(range(size))[share] == expected


def test_the_readme_share_per_rank_is_the_arithmetic():
    """README: an adapter on all 7 projections of a Llama-3-8B, per rank, as a share of the unsplit adapter."""
    hidden, kv_width, intermediate = 4096, 1024, 14336
    column = [(hidden, hidden), (hidden, kv_width), (hidden, kv_width), (hidden, intermediate), (hidden, intermediate)]
    row = [(hidden, hidden), (intermediate, hidden)]
    unsplit = sum(i + o for i, o in column + row)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    shares = {tp: (sum(i + o // tp for i, o in column) + sum(i // tp + o for i, o in row)) / unsplit for tp in (2, 4, 8)}
    claim = f"{shares[2]:.0%} of the unsplit adapter per rank at tp=2, {shares[4]:.0%} at 4 and {shares[8]:.0%} at 8"
    assert " ".join(claim.split()) in " ".join(readme.split())
