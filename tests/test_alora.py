"""aLoRA (activated LoRA, PEFT's ``LoraConfig(alora_invocation_tokens=...)``) equals PEFT.

An aLoRA adapter applies only from the start of the last occurrence of its invocation tokens in a row's input on,
and to every generated token; before it, and in rows that lack the invocation, the row runs as the base model.
PEFT adapters are saved by PEFT in the test (random non-zero factors) and read from their folders. Mixed batches
(aLoRA rows with the invocation at several places or absent, plain LoRA rows, base rows) through one
``MultiLoraModel`` equal PEFT's ``PeftModel``, one adapter at a time, row by row: logits and ``generate()``; the
engine gives the tokens of ``generate()``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from helpers import PeftOracleSetup as Setup
from helpers import assert_state_unchanged, capture_state, left_padded, save_peft_adapter, tiny_llama
from peft import PeftModel
from transformers import GenerationConfig

from punica_hf import MultiLoraModel
from punica_hf.formats import (
    AdapterWeights, LoraAdapterConfig, ModuleLora, convert_adapter, load_converted, save_converted,
)
from punica_hf.model import alora_start
from punica_hf.serving import Engine, EngineConfig, SamplingParams

ATOL = 2e-5
VOCAB = 96
FIRST_FREE_TOKEN = 10  # prompts are drawn from [10, VOCAB): the invocations below occur only where they are put
ADAPTERS = {
    "two_tokens": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj", "lm_head"],
                       alora_invocation_tokens=[3, 4]),
    "one_token": dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["k_proj", "gate_proj", "up_proj"],
                      alora_invocation_tokens=[5]),
    "plain": dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]),
}
# (adapter, where its invocation goes in a row of random tokens: indices, counted from the row's start)
ROWS = [
    ("two_tokens", [4]),  # in the middle
    ("one_token", [2, 6]),  # twice: the last one counts
    (None, [3]),  # a base row holding an invocation: still the base model
    ("two_tokens", []),  # absent: the base model, generated tokens too
    ("plain", [1]),  # plain LoRA ignores invocations
    ("one_token", ["end"]),  # the prompt's last token
    ("two_tokens", [0]),  # the prompt's first tokens: every position
    ("two_tokens", ["half"]),  # only the invocation's first token, at the end: absent
]
LENGTHS = [9, 10, 6, 7, 5, 8, 6, 9]


def make_base() -> torch.nn.Module:
    base = tiny_llama(vocab_size=VOCAB, max_position_embeddings=1024)
    base.generation_config.eos_token_id = None  # every row runs to max_new_tokens
    return base


def save_adapters(base: torch.nn.Module, root: Path) -> dict[str, Path]:
    return {
        name: save_peft_adapter(base, root / name, seed=seed, task_type="CAUSAL_LM", **config)
        for seed, (name, config) in enumerate(ADAPTERS.items(), start=1)
    }


def prompt(adapter: str | None, places: list, length: int, seed: int) -> list[int]:
    tokens = torch.randint(FIRST_FREE_TOKEN, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    invocation = ADAPTERS.get(adapter, {}).get("alora_invocation_tokens") or [3, 4]
    for place in places:
        if place == "half":
            tokens[-1] = invocation[0]
            continue
        start = length - len(invocation) if place == "end" else place
        tokens[start : start + len(invocation)] = invocation
    return tokens


def batch(seed: int = 0) -> tuple[list[str | None], torch.Tensor, torch.Tensor]:
    prompts = [prompt(adapter, places, length, seed * 100 + row)
               for row, ((adapter, places), length) in enumerate(zip(ROWS, LENGTHS))]
    return [adapter for adapter, _ in ROWS], *left_padded(prompts)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    base = make_base()
    paths = save_adapters(base, tmp_path_factory.mktemp("adapters"))
    names = list(paths)
    peft = PeftModel.from_pretrained(copy.deepcopy(base), paths[names[0]], adapter_name=names[0]).eval()
    for name in names[1:]:
        peft.load_adapter(paths[name], adapter_name=name)
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=4, max_rank=8)
    model.load_adapters(paths)
    return Setup(model, base, peft, paths)


def test_the_first_position_an_adapter_applies_to():
    assert alora_start(None, [7, 8]) == 0  # plain LoRA: every position
    assert alora_start([3, 4], [1, 3, 4, 2, 3, 4, 9]) == 4  # the last occurrence
    assert alora_start([3, 4], [3, 4]) == 0
    assert alora_start([3, 4], [1, 2, 3]) is None  # only part of it
    assert alora_start([3], []) is None


@pytest.mark.parametrize("seed", [0, 1])
@torch.no_grad()
def test_mixed_batch_logits_match_peft_row_by_row(setup, seed):
    rows, input_ids, attention_mask = batch(seed)
    logits, base_logits, real = setup.mixed_logits(input_ids, attention_mask, rows, ATOL)
    for row, adapter in enumerate(rows):
        # the adapter changes exactly the positions from its first one on, as PEFT's oracle above
        invocation = ADAPTERS.get(adapter, {}).get("alora_invocation_tokens") if adapter else None
        start = None if adapter is None else alora_start(invocation, input_ids[row].tolist())
        changed = (logits[row] - base_logits[row]).abs().amax(dim=-1) > 1e-4
        positions = torch.arange(input_ids.shape[1])
        assert torch.equal(changed[real[row]], (positions >= (start if start is not None else 1 << 30))[real[row]])


@torch.no_grad()
def test_per_token_adapter_ids_are_taken_as_given(setup):
    """Per-token entries choose each token's adapter themselves: -1 before each row's start equals the per-row call."""
    rows, input_ids, attention_mask = batch(seed=5)
    indices = torch.tensor([-1 if adapter is None else setup.model.adapters[adapter] for adapter in rows])
    every_token = indices[:, None].expand(input_ids.shape).clone()
    from_start = every_token.clone()
    for row, adapter in enumerate(rows):
        invocation = ADAPTERS.get(adapter, {}).get("alora_invocation_tokens") if adapter else None
        start = alora_start(invocation, input_ids[row].tolist())
        from_start[row, : input_ids.shape[1] if start is None else start] = -1
    by_row = setup.model(input_ids, attention_mask=attention_mask, adapter_ids=rows).logits
    by_token = setup.model(input_ids, attention_mask=attention_mask, adapter_ids=from_start).logits
    torch.testing.assert_close(by_token, by_row, atol=1e-6, rtol=0)
    on_every_token = setup.model(input_ids, attention_mask=attention_mask, adapter_ids=every_token).logits
    assert (on_every_token - by_row).abs().max() > 1e-3  # not masked: per-token entries are not searched


GENERATION_MODES = {
    "greedy": dict(do_sample=False),
    "greedy_static_cache": dict(do_sample=False, cache_implementation="static"),
}


@pytest.mark.parametrize("mode", sorted(GENERATION_MODES))
@torch.no_grad()
def test_generate_matches_peft_row_by_row(setup, mode):
    kwargs = dict(GENERATION_MODES[mode], max_new_tokens=6, pad_token_id=0)
    rows, input_ids, attention_mask = batch(seed=2)
    generated = setup.model.generate(input_ids, attention_mask=attention_mask, adapter_ids=rows, **kwargs)
    plain = setup.base.generate(input_ids, attention_mask=attention_mask, **kwargs)
    for row, (adapter, places) in enumerate(ROWS):
        expected = setup.oracle(adapter).generate(input_ids, attention_mask=attention_mask, **kwargs)
        assert torch.equal(generated[row], expected[row]), f"row {row} ({adapter}, {places}) differs"
        if adapter is not None and places not in ([], ["half"]):  # an invoked adapter changes the tokens
            assert not torch.equal(generated[row], plain[row]), f"row {row} ({adapter}) runs as the base model"


@torch.no_grad()
def test_returned_sequences_keep_their_rows_offsets(setup):
    """generate() repeats each row's offset with the row (num_return_sequences): the same as the rows repeated."""
    rows, input_ids, attention_mask = batch(seed=6)
    kwargs = dict(do_sample=True, top_k=0, max_new_tokens=5, pad_token_id=0)
    torch.manual_seed(0)
    returned = setup.model.generate(input_ids, attention_mask=attention_mask, adapter_ids=rows,
                                    num_return_sequences=2, **kwargs)
    torch.manual_seed(0)
    repeated = setup.model.generate(input_ids.repeat_interleave(2, dim=0),
                                    attention_mask=attention_mask.repeat_interleave(2, dim=0),
                                    adapter_ids=[adapter for adapter in rows for _ in range(2)], **kwargs)
    assert torch.equal(returned, repeated)


@torch.no_grad()
def test_an_absent_invocation_runs_the_row_as_the_base_model_through_generation(setup):
    """Generated tokens do not activate the adapter: PEFT looks for the invocation in the prompt only."""
    input_ids = torch.tensor([prompt("two_tokens", [], 8, seed=7)])
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(setup.model.generate(input_ids, adapter_ids=["two_tokens"], **kwargs),
                       setup.base.generate(input_ids, **kwargs))


@torch.no_grad()
def test_a_converted_adapter_keeps_its_invocation(setup, tmp_path):
    converted = convert_adapter(setup.paths["two_tokens"], tmp_path / "two_tokens.safetensors")
    model = MultiLoraModel(copy.deepcopy(setup.base), max_adapters=2, max_rank=8)
    model.load_adapters({"converted": converted, "folder": setup.paths["two_tokens"]})
    rows, input_ids, attention_mask = batch(seed=3)
    from_file = model(input_ids, attention_mask=attention_mask, adapter_ids=["converted"] * len(rows)).logits
    from_folder = model(input_ids, attention_mask=attention_mask, adapter_ids=["folder"] * len(rows)).logits
    torch.testing.assert_close(from_file, from_folder, atol=1e-6, rtol=0)


def test_a_config_made_in_code_keeps_its_invocation_through_a_converted_file(tmp_path):
    config = LoraAdapterConfig(r=2, lora_alpha=4, alora_invocation_tokens=[3, 4])
    factors = ModuleLora(torch.randn(2, 32), torch.randn(32, 2))
    weights = AdapterWeights({"model.layers.0.self_attn.q_proj": factors}, config, source="code")
    assert config.alora_invocation_tokens == (3, 4)
    read_back = load_converted(save_converted(weights, tmp_path / "made_in_code.safetensors"))
    assert read_back.config.alora_invocation_tokens == (3, 4)


@torch.no_grad()
def test_alora_needs_input_ids_and_refuses_prompt_lookup(setup):
    input_ids = torch.tensor([prompt("one_token", [3], 8, seed=4)])
    embeds = setup.base.get_input_embeddings()(input_ids)
    with pytest.raises(ValueError, match="aLoRA adapters need input_ids"):
        setup.model(inputs_embeds=embeds, adapter_ids=["one_token"])
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens.*aLoRA"):
        setup.model.generate(input_ids, adapter_ids=["one_token"], prompt_lookup_num_tokens=2, max_new_tokens=3)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens.*aLoRA"):
        setup.model.generate(input_ids, adapter_ids=["one_token"], max_new_tokens=3,
                             generation_config=GenerationConfig(prompt_lookup_num_tokens=2))
    with pytest.raises(ValueError, match="alora_offsets needs adapter_ids with one slot per row"):
        setup.model.model(input_ids, alora_offsets=torch.tensor([1]))  # the inner forward, called directly
    # plain LoRA rows keep both
    setup.model(inputs_embeds=embeds, adapter_ids=["plain"])


def test_alora_on_an_embedding_layer_is_refused(setup, tmp_path):
    """PEFT refuses aLoRA on embeddings; a config edited to ask for it is refused at load, and nothing registered."""
    folder = save_peft_adapter(setup.base, tmp_path / "embed", r=4, target_modules=["embed_tokens", "q_proj"])
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "alora_invocation_tokens": [3]}))
    rows, input_ids, _ = batch()
    state = capture_state(setup.model, input_ids, rows)
    with pytest.raises(ValueError, match=r"aLoRA on embedding layers is not supported.*embed_tokens"):
        setup.model.load_adapters({"also": setup.paths["plain"], "embed": folder})
    assert_state_unchanged(setup.model, state)


@pytest.mark.parametrize("value", ["3", [3, -1], [1.5], [True], {"a": 1}])
def test_bad_invocation_tokens_are_refused_by_name(value):
    with pytest.raises(ValueError, match="alora_invocation_tokens must be a non-empty list of token ids"):
        LoraAdapterConfig.from_dict({"peft_type": "LORA", "r": 4, "alora_invocation_tokens": value})


def engine_model(tmp_path: Path) -> MultiLoraModel:
    base = make_base()
    model = MultiLoraModel(base, max_adapters=4, max_rank=8)
    model.load_adapters(save_adapters(base, tmp_path))
    return model


def generated(model: MultiLoraModel, adapter: str | None, tokens: list[int], new_tokens: int) -> list[int]:
    output = model.generate(torch.tensor([tokens]), adapter_ids=[adapter], max_new_tokens=new_tokens,
                            do_sample=False, pad_token_id=0)
    return output[0, len(tokens) :].tolist()


def run(engine: Engine, tokens: list[int], adapter: str | None, new_tokens: int = 5) -> tuple[list[int], int]:
    """The request's new tokens, and the prompt tokens it took from shared pages."""
    hits = engine.stats().prefix_hit_tokens
    completion = engine.submit(tokens, adapter, SamplingParams(max_new_tokens=new_tokens)).result(timeout=120)
    return list(completion.token_ids), engine.stats().prefix_hit_tokens - hits


@torch.no_grad()
def test_engine_tokens_equal_generate(tmp_path):
    """Interleaved aLoRA, plain and base requests; prefills split over steps of 16 tokens, so an invocation's start
    falls inside a step, at a step's first token, or in an earlier step."""
    model = engine_model(tmp_path)
    plan = [  # (adapter, invocation places, prompt length)
        ("two_tokens", [20], 40), ("plain", [], 12), ("one_token", [16], 30), ("two_tokens", [], 25),
        (None, [5], 18), ("one_token", [3, 33], 35), ("two_tokens", ["end"], 9), ("one_token", [0], 7),
    ]
    requests = [(adapter, prompt(adapter, places, length, seed), 3 + seed % 4)
                for seed, (adapter, places, length) in enumerate(plan)]
    expected = [generated(model, adapter, tokens, n) for adapter, tokens, n in requests]
    with Engine(model, config=EngineConfig(max_running=4, max_batch_tokens=16)) as engine:
        handles = [engine.submit(tokens, adapter, SamplingParams(max_new_tokens=n)) for adapter, tokens, n in requests]
        assert [list(handle.result(timeout=120).token_ids) for handle in handles] == expected


PAGE = 256  # tokens of a KV page on the CPU


@torch.no_grad()
def test_prefix_pages_follow_where_the_adapter_starts(tmp_path):
    """An aLoRA request's pages hold base-model keys before its invocation and the adapter's after, so they are
    shared only with requests of the same adapter that start it at the same position; without an invocation the
    request runs as the base model and shares the base model's pages."""
    model = engine_model(tmp_path)
    first = prompt("two_tokens", [50], PAGE + 40, seed=1)
    same_start = first[:-20] + prompt(None, [], 20, seed=2)  # the same first page, the same invocation
    later_start = first[:-20] + prompt("two_tokens", [10], 20, seed=3)  # the same first page, a later invocation
    no_invocation = prompt(None, [], PAGE + 30, seed=4)
    answers = {name: generated(model, adapter, tokens, 5) for name, adapter, tokens in [
        ("first", "two_tokens", first), ("same", "two_tokens", same_start), ("later", "two_tokens", later_start),
        ("base", None, no_invocation), ("absent", "two_tokens", no_invocation)]}
    assert answers["base"] == answers["absent"]
    with Engine(model, config=EngineConfig(max_running=4)) as engine:
        assert run(engine, first, "two_tokens") == (answers["first"], 0)
        tokens, hits = run(engine, same_start, "two_tokens")
        assert tokens == answers["same"] and hits >= PAGE
        assert run(engine, later_start, "two_tokens") == (answers["later"], 0)
        assert run(engine, no_invocation, None) == (answers["base"], 0)
        tokens, hits = run(engine, no_invocation, "two_tokens")
        assert tokens == answers["absent"] and hits >= PAGE
