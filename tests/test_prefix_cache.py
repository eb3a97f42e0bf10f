"""Prefix caching keyed by adapter: a prompt prefix's KV pages are shared between requests of the same adapter load
(or of the base model), never between adapters, whose keys and values differ.

Every answer is compared with ``generate()`` of the same prompt and adapter, computed before the engine takes the
model; ``EngineStats.prefix_hit_tokens`` counts the prompt tokens served from shared pages.
"""

import pytest
import torch
from helpers import save_peft_adapter, tiny_llama

from punica_hf import MultiLoraModel
from punica_hf.serving import Engine, EngineConfig, SamplingParams
from punica_hf.serving.metrics import ServingMetrics

NEW_TOKENS = 6
PROMPT_LENGTH = 300  # more than one KV page (256 tokens on the CPU), so a full page can be shared


def tiny_base():
    base = tiny_llama(max_position_embeddings=1024)
    base.generation_config.eos_token_id = None  # every request runs to its max_new_tokens
    return base


def prompt(seed: int, length: int = PROMPT_LENGTH) -> list[int]:
    return torch.randint(1, 100, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


SHARED = prompt(0)
OTHER_END = SHARED[:-20] + prompt(1, 20)  # the same first page, another ending


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    return {
        name: save_peft_adapter(tiny_base(), folder / name, seed=10 + i, r=4, lora_alpha=16,
                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        for i, name in enumerate(["a", "b", "c"])
    }


@pytest.fixture(scope="module")
def model_and_answers(adapters):
    model = MultiLoraModel(tiny_base(), max_adapters=3)
    model.load_adapters(adapters)
    answers = {}
    for adapter in ["a", "b", "c", None]:
        for name, tokens in (("shared", SHARED), ("other end", OTHER_END)):
            output = model.generate(torch.tensor([tokens]), adapter_ids=[adapter], max_new_tokens=NEW_TOKENS,
                                    do_sample=False, pad_token_id=0)
            answers[adapter, name] = output[0, len(tokens):].tolist()
    assert len({tuple(answers[a, "shared"]) for a in ["a", "b", "c", None]}) == 4  # the adapters matter here
    return model, answers


def run(engine: Engine, tokens: list[int], adapter: str | None) -> tuple[list[int], int]:
    """The request's new tokens, and the prompt tokens it took from shared pages."""
    hits = engine.stats().prefix_hit_tokens
    completion = engine.submit(tokens, adapter, SamplingParams(max_new_tokens=NEW_TOKENS)).result(timeout=120)
    return list(completion.token_ids), engine.stats().prefix_hit_tokens - hits


def test_the_same_prefix_and_adapter_share_pages_and_other_adapters_never(model_and_answers):
    model, answers = model_and_answers
    with Engine(model, None, EngineConfig(max_running=4)) as engine:
        first, first_hits = run(engine, SHARED, "a")
        assert first == answers["a", "shared"] and first_hits == 0
        again, hits = run(engine, OTHER_END, "a")  # the same first page, same adapter: shared
        assert again == answers["a", "other end"]
        assert hits >= 256
        for adapter in ["b", None]:  # the same tokens under another adapter, or none: computed anew
            tokens, hits = run(engine, SHARED, adapter)
            assert tokens == answers[adapter, "shared"], adapter
            assert hits == 0, adapter
        base_again, hits = run(engine, OTHER_END, None)  # the base model's own pages are shared among base requests
        assert base_again == answers[None, "other end"] and hits >= 256
        metrics = ServingMetrics(engine).render()[0].decode()
        assert f"punica_prefix_cache_hit_tokens_total {float(engine.stats().prefix_hit_tokens)}" in metrics
        assert engine.stats().kv_free_fraction == 1.0  # pages kept for sharing are given back on demand: free


def test_an_adapter_loaded_again_under_its_name_never_meets_its_old_pages(model_and_answers, adapters):
    model, answers = model_and_answers
    with Engine(model, None, EngineConfig(max_running=4)) as engine:
        assert run(engine, SHARED, "c")[0] == answers["c", "shared"]
        model.unload_adapter("c")
        model.load_adapters({"c": adapters["b"]})  # another adapter's weights under the same name (and slot)
        try:
            tokens, hits = run(engine, SHARED, "c")
            assert tokens == answers["b", "shared"] and hits == 0
        finally:
            model.unload_adapter("c")
            model.load_adapters({"c": adapters["c"]})


def test_prefix_caching_can_be_turned_off(model_and_answers):
    model, answers = model_and_answers
    with Engine(model, None, EngineConfig(max_running=4, prefix_caching=False)) as engine:
        for _ in range(2):
            tokens, hits = run(engine, SHARED, "a")
            assert tokens == answers["a", "shared"] and hits == 0


@pytest.mark.parametrize("value", [1, "yes", None])
def test_prefix_caching_is_a_bool(value):
    with pytest.raises(ValueError, match="prefix_caching must be True or False"):
        EngineConfig(prefix_caching=value)


def test_an_alora_request_shares_the_base_models_pages_before_its_invocation(tmp_path):
    """aLoRA leaves the prompt before its invocation to the base model, so the pages wholly before it are the base
    model's: a base request and an aLoRA request with the same first page share it, either one first. A page the
    invocation falls in is the adapter's, never shared with the base model. Every answer equals ``generate()``."""
    base = tiny_base()
    alora = save_peft_adapter(base, tmp_path / "alora", seed=5, r=4, lora_alpha=16,
                              target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], alora_invocation_tokens=[3, 4])
    model = MultiLoraModel(base, max_adapters=1)
    model.load_adapters({"alora": alora})

    def words(seed: int, length: int) -> list[int]:  # ids from 10 on: the invocation occurs only where put
        return torch.randint(10, 100, (length,), generator=torch.Generator().manual_seed(seed)).tolist()

    first_page = words(20, 256)
    late = first_page + words(21, 20) + [3, 4] + words(22, 10)  # invoked after the first page
    early = first_page[:200] + [3, 4] + first_page[202:] + words(23, 30)  # invoked inside the first page
    plain = first_page + words(24, 25)
    answers = {}
    for adapter, tokens in (("alora", late), ("alora", early), (None, plain)):
        output = model.generate(torch.tensor([tokens]), adapter_ids=[adapter], max_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=0)
        answers[adapter, tuple(tokens)] = output[0, len(tokens):].tolist()
    assert answers["alora", tuple(late)] != model.generate(
        torch.tensor([late]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0, len(late):].tolist()
    for order in ([(None, plain), ("alora", late)], [("alora", late), (None, plain)]):
        with Engine(model, None, EngineConfig(max_running=4)) as engine:
            (adapter, tokens), (second_adapter, second_tokens) = order
            assert run(engine, tokens, adapter) == (answers[adapter, tuple(tokens)], 0)
            assert run(engine, second_tokens, second_adapter) == (answers[second_adapter, tuple(second_tokens)], 256)
    with Engine(model, None, EngineConfig(max_running=4)) as engine:
        assert run(engine, plain, None) == (answers[None, tuple(plain)], 0)
        assert run(engine, early, "alora") == (answers["alora", tuple(early)], 0)  # its first page is its own
        assert run(engine, plain, None)[1] >= 256  # the base model's pages are still there


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_shared_pages_give_the_greedy_tokens_and_never_cross_adapters(tmp_path):
    """The paged kernel in bf16, steps replayed from CUDA graphs: a request whose first page a request of its adapter
    filled takes it (counted); the same tokens under another adapter, or none, are computed anew; every token is
    the greedy choice of the model's own forward over the same tokens, up to bf16 rounding (a shared page was
    computed in another batch than a fresh one would be)."""
    from test_engine import assert_greedy_up_to_rounding, bf16_model_on_the_paged_kernel

    model = bf16_model_on_the_paged_kernel(tmp_path, seed=6)
    plan = [("a", SHARED), ("a", OTHER_END), ("b", SHARED), (None, SHARED), (None, OTHER_END), ("b", OTHER_END)]
    shares = [False, True, False, False, True, True]
    config = EngineConfig(max_running=4, max_batch_tokens=256, kv_blocks=64, cuda_graphs=True)
    completions, hits = [], []
    with Engine(model, None, config) as engine:
        assert engine.stats().cuda_graphs > 0
        for adapter, tokens in plan:  # one at a time: each finds what the earlier ones left
            before = engine.stats().prefix_hit_tokens
            completions.append(engine.submit(tokens, adapter, SamplingParams(max_new_tokens=NEW_TOKENS)).result(
                timeout=120))
            hits.append(engine.stats().prefix_hit_tokens - before)
    assert [count >= 256 for count in hits] == shares, hits
    assert [count == 0 for count in hits] == [not share for share in shares], hits
    assert_greedy_up_to_rounding(model, [(adapter, tokens, NEW_TOKENS) for adapter, tokens in plan], completions)
