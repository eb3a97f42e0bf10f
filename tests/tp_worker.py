"""One rank of tests/test_tp.py: run under ``torchrun --nproc-per-node 2`` (gloo, CPU) by that test, never alone.

``python tp_worker.py ROOT``: ROOT holds the tiny models (``ROOT/models/<name>``) and PEFT adapters
(``ROOT/adapters/<model>/<name>``) the test saved. Each rank loads every model twice, split by transformers' tensor
parallelism and whole, runs the same calls on both and writes what it saw to ``ROOT/rank<R>.json``; the test
compares (the tolerances live there). One process run checks everything, since starting ranks costs seconds.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DistributedConfig

from punica_hf import MultiLoraModel, injection
from two_ranks import finish_rank

ROOT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
PROMPTS = torch.tensor([[5, 17, 33, 2, 9, 41], [7, 7, 12, 60, 3, 11], [1, 2, 3, 4, 5, 6], [88, 14, 29, 70, 51, 8]])


def load(model: str, tensor_parallel: bool) -> torch.nn.Module:
    """The model whole, or split over the ranks (both of transformers' entry points: "odd" by ``tp_plan``)."""
    if not tensor_parallel:
        split = {}
    elif model == "odd":
        split = dict(tp_plan="auto")
    else:
        split = dict(distributed_config=DistributedConfig(tp_plan="auto"))
    return AutoModelForCausalLM.from_pretrained(ROOT / "models" / model, dtype=torch.float32, **split).eval()


def adapters(model: str, *names: str) -> dict[str, Path]:
    return {name: ROOT / "adapters" / model / name for name in names}


def refusal(call) -> str | None:
    """The ValueError message of ``call()``, None when it raised none."""
    try:
        call()
    except ValueError as error:
        return str(error)
    return None


def biggest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def compare_model(model: str, names: list[str], row_adapters: list, results: dict) -> None:
    """Logits (per row and per token) and greedy tokens of the split model against the whole one."""
    whole = MultiLoraModel(load(model, False), max_adapters=4, max_rank=16)
    whole.load_adapters(adapters(model, *names))
    split_base = load(model, True)
    tp_forwards = {name: m.__dict__.get("forward") for name, m in split_base.named_modules()}
    with torch.no_grad():
        base_logits = split_base(PROMPTS).logits
    split = MultiLoraModel(split_base, max_adapters=4, max_rank=16)
    split.load_adapters(adapters(model, *names))
    token_adapters = [[row_adapters[(row + token) % len(row_adapters)] for token in range(PROMPTS.shape[1])]
                      for row in range(PROMPTS.shape[0])]
    token_ids = torch.tensor([[-1 if a is None else split.adapters[a] for a in row] for row in token_adapters])
    with torch.no_grad():
        expected = whole(PROMPTS, adapter_ids=row_adapters).logits
        results["logits_difference"] = biggest_difference(split(PROMPTS, adapter_ids=row_adapters).logits, expected)
        results["lora_effect"] = biggest_difference(whole(PROMPTS).logits, expected)
        results["per_token_difference"] = biggest_difference(
            split(PROMPTS, adapter_ids=token_ids).logits, whole(PROMPTS, adapter_ids=token_ids).logits
        )
    generate = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    results["tokens"] = split.generate(PROMPTS, adapter_ids=row_adapters, **generate).tolist()
    results["expected_tokens"] = whole.generate(PROMPTS, adapter_ids=row_adapters, **generate).tolist()
    results["base_tokens"] = whole.generate(PROMPTS, **generate).tolist()
    results["factor_bytes"] = [split.adapter_stats[k] for k in ("factor_bytes", "factor_bytes_unsplit")]
    results["whole_factor_bytes"] = [whole.adapter_stats[k] for k in ("factor_bytes", "factor_bytes_unsplit")]
    results["grouped_modules"] = sorted(split._injection.groups or {})
    results["local_widths"] = {
        name: [m.in_features, m.out_features]
        for name, m in split._injection.linear_modules().items() if name.startswith("model.layers.0.")
    }
    unwrapped = split.unwrap()
    with torch.no_grad():
        results["unwrapped_difference"] = biggest_difference(unwrapped(PROMPTS).logits, base_logits)
    results["unwrapped_forwards_restored"] = unwrapped is split_base and all(
        m.__dict__.get("forward") is tp_forwards[name] for name, m in unwrapped.named_modules()
    )


def eviction_and_refusals(results: dict) -> None:
    """More adapters than slots, reloaded under TP; then each refusal, which must change nothing."""
    names = ["attn", "mlp", "wide"]
    whole = MultiLoraModel(load("even", False), max_adapters=4, max_rank=16)
    whole.load_adapters(adapters("even", *names))
    split = MultiLoraModel(load("even", True), max_adapters=2, max_rank=16)
    split.load_adapters(adapters("even", *names))
    differences = []
    for batch in (["attn", "mlp", None, "attn"], ["wide", None, "wide", "mlp"], ["attn", "wide", "attn", None]):
        with torch.no_grad():
            differences.append(biggest_difference(
                split(PROMPTS, adapter_ids=batch).logits, whole(PROMPTS, adapter_ids=batch).logits
            ))
    results["eviction_differences"] = differences
    results["evictions"] = split.adapter_stats["evictions"]

    # An unload while a request holds the adapter (a scheduler's lease): the request finishes with it as it was.
    generate = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = whole.generate(PROMPTS, adapter_ids=["mlp"] * 4, **generate).tolist()
    lease = split.acquire(["mlp"] * 4)
    split.unload_adapter("mlp")
    slots = torch.tensor(lease.slots)
    results["unloaded_while_held"] = "mlp" not in split.adapters
    results["held_tokens"] = split.model.generate(PROMPTS, adapter_ids=slots, **generate).tolist()
    results["held_expected_tokens"] = expected
    lease.release()
    results["resident_after_release"] = split.adapter_stats["resident"]
    split.load_adapters(adapters("even", "mlp"))

    before, stats_before = split.adapters, split.adapter_stats
    refusals = {
        "gradients": refusal(lambda: split(PROMPTS, adapter_ids=["attn"] * 4)),
        "lm_head": refusal(lambda: split.load_adapters(adapters("even", "head"))),
        "embedding": refusal(lambda: split.load_adapters(adapters("even", "embed"))),
        "misfit": refusal(lambda: split.load_adapters({"misfit": ROOT / "adapters" / "odd" / "mlp"})),
    }
    results["refusals"] = refusals
    results["adapters_unchanged"] = split.adapters == before
    results["stats_unchanged"] = split.adapter_stats == stats_before  # no adapter placed or evicted either
    after = ["wide", None, "attn", "wide"]
    with torch.no_grad():
        results["after_refusals_difference"] = biggest_difference(
            split(PROMPTS, adapter_ids=after).logits, whole(PROMPTS, adapter_ids=after).logits
        )


def interrupted_load(results: dict) -> None:
    """A load that fails halfway through hooking split layers leaves every layer as it was (all or nothing)."""
    base = load("even", True)
    tp_forwards = {name: m.__dict__.get("forward") for name, m in base.named_modules()}
    with torch.no_grad():
        base_logits = base(PROMPTS).logits
    split = MultiLoraModel(base, max_adapters=2, max_rank=16)
    wrap, wrapped = injection.wrap, []

    def wrap_twice_then_fail(module, layer_split):
        if len(wrapped) == 2:
            raise RuntimeError("interrupted")
        wrapped.append(module)
        wrap(module, layer_split)

    injection.wrap = wrap_twice_then_fail
    try:
        split.load_adapters(adapters("even", "attn"))
    except RuntimeError as error:
        results["error_message"] = str(error)
    finally:
        injection.wrap = wrap
    results["adapters"] = split.adapters
    results["forwards_restored"] = all(  # every layer ("" is the model, whose forward the wrapper took)
        m.__dict__.get("forward") is tp_forwards[name] for name, m in base.named_modules() if name
    )
    with torch.no_grad():
        results["logits_difference"] = biggest_difference(split(PROMPTS).logits, base_logits)


def packed_refusal(results: dict) -> None:
    """A layer of a style LoRA is not served on under TP (a packed projection) is refused by name."""
    plan = {"model.layers.*.mlp.gate_proj": "packed_colwise", "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.*.mlp.down_proj": "rowwise"}
    model = AutoModelForCausalLM.from_pretrained(
        ROOT / "models" / "even", dtype=torch.float32, distributed_config=DistributedConfig(tp_plan=plan)
    ).eval()
    wrapped = MultiLoraModel(model, max_adapters=2, max_rank=16)
    results["packed"] = refusal(lambda: wrapped.load_adapters(adapters("even", "mlp")))
    results["packed_adapters"] = wrapped.adapters


def vector_adapters(results: dict) -> None:
    """DoRA, LoRA bias and bias="all" (its biases of k/v checked against this rank's rows) on column-split layers
    against the whole model; DoRA on a row-split layer is refused."""
    compare_model("qwen2", ["dora", "lora_bias", "attn", "bias_all"], ["dora", "bias_all", "lora_bias", None], results)
    split = MultiLoraModel(load("even", True), max_adapters=2, max_rank=16)
    results["row_split"] = refusal(lambda: split.load_adapters(adapters("even", "dora_o")))
    results["row_split_adapters"] = split.adapters


def main() -> None:
    results: dict = {}
    for section, run in (
        ("even", lambda r: compare_model("even", ["attn", "mlp", "wide"], ["attn", None, "mlp", "wide"], r)),
        ("odd", lambda r: compare_model("odd", ["attn", "mlp"], ["mlp", "attn", None, "mlp"], r)),
        ("qwen2", lambda r: compare_model("qwen2", ["attn", "mlp"], [None, "attn", "mlp", "attn"], r)),
        ("eviction", eviction_and_refusals),
        ("vectors", vector_adapters),
        ("packed", packed_refusal),
        ("interrupted", interrupted_load),
    ):
        results[section] = {}
        try:
            run(results[section])
        except Exception:  # every rank reports what failed, so the test shows it
            results[section]["error"] = traceback.format_exc()
    finish_rank(ROOT, results)


if __name__ == "__main__":
    main()
