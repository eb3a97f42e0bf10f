"""The serving engine without HTTP: continuous batching in which every request has its own adapter and settings.

Greedy outputs are compared with ``generate()`` of the same prompt and adapter, computed before the engine takes
the model (transformers' continuous batching may switch the model's attention implementation while it runs).
"""

import math
import re
import shutil
import threading
import time
from collections.abc import Callable

import pytest
import torch
from architectures import ARCHITECTURES, make_base_and_adapters
from helpers import save_peft_adapter, tiny_llama
from safetensors.torch import load_file, save_file

from punica_hf import MultiLoraModel, demo
from punica_hf.serving import (
    Completion,
    DemoTokenizer,
    Engine,
    EngineClosedError,
    EngineConfig,
    QueueFullError,
    SamplingParams,
    TextStream,
)
from punica_hf.serving.engine import ADAPTER_NOT_FOUND, GENERATION_FAILED, MAX_REQUEST_ID_LENGTH, SHUT_DOWN

WORDS = demo.sample_words(6, seed=7, held_out=True)
DEMO_ADAPTERS = [*demo.TASKS, None]
TINY_ADAPTERS = ["a", "b", "c"]


@pytest.fixture(scope="module")
def demo_model():
    """The demo model with its three adapters, and the greedy answers of ``generate()`` per (adapter, word)."""
    model = MultiLoraModel(demo.load_base_model(), max_adapters=3)
    model.load_adapters(demo.adapter_paths())
    answers = {
        adapter: dict(zip(WORDS, demo.generate_answers(model, WORDS, adapter_ids=[adapter] * len(WORDS))))
        for adapter in DEMO_ADAPTERS
    }
    return model, answers


@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory):
    """PEFT folders of three random adapters for ``tiny_base()``."""
    folder = tmp_path_factory.mktemp("adapters")
    return {
        name: save_peft_adapter(tiny_base(), folder / name, seed=i, r=4, lora_alpha=8,
                                target_modules=["q_proj", "v_proj", "down_proj"])
        for i, name in enumerate(TINY_ADAPTERS)
    }


@pytest.fixture(scope="module")
def tiny_model(tiny_adapters):
    model = MultiLoraModel(tiny_base(), max_adapters=len(tiny_adapters))
    model.load_adapters(tiny_adapters)
    return model


def tiny_base():
    """A tiny random Llama without an end-of-sequence token: every request runs to its max_new_tokens."""
    base = tiny_llama(max_position_embeddings=256)
    base.generation_config.eos_token_id = None
    return base


def reference_tokens(model, prompt: list[int], adapter: str | None, new_tokens: int) -> list[int]:
    output = model.generate(
        torch.tensor([prompt], device=model.device), adapter_ids=[adapter], max_new_tokens=new_tokens,
        do_sample=False, pad_token_id=0,
    )
    return output[0, len(prompt):].tolist()


def tiny_prompt(seed: int, length: int) -> list[int]:
    return torch.randint(1, 100, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_concurrent_greedy_requests_equal_generate_for_every_adapter(demo_model):
    model, answers = demo_model
    requests = [(word, adapter) for word in WORDS for adapter in DEMO_ADAPTERS]
    params = SamplingParams(max_new_tokens=demo.MAX_ANSWER_TOKENS)
    with Engine(model, DemoTokenizer(), EngineConfig(max_running=8)) as engine:
        handles = [engine.submit(demo.make_prompt(word), adapter, params) for word, adapter in requests]
        completions = [handle.result(timeout=60) for handle in handles]
        stats = engine.stats()
    for (word, adapter), completion in zip(requests, completions):
        assert completion.text == answers[adapter][word], (word, adapter)
        assert completion.finish_reason == "stop"  # the demo answers end with EOS
        assert completion.adapter == adapter
    for word in WORDS:  # each adapter does its own task
        assert len({c.text for (w, _), c in zip(requests, completions) if w == word}) == len(DEMO_ADAPTERS)
    assert stats.steps < sum(c.completion_tokens for c in completions)  # requests shared steps
    assert stats.generated_tokens == sum(c.completion_tokens for c in completions)
    assert stats.finished["stop"] == len(requests) and stats.running == stats.queued == 0


def test_requests_join_and_leave_a_running_batch_with_outputs_unchanged(tiny_model):
    """A long request runs while others arrive mid-way, and short ones finish and leave before it ends."""
    plan = [  # (adapter, prompt, new tokens)
        ("a", tiny_prompt(0, 5), 60),
        ("b", tiny_prompt(1, 9), 3),
        (None, tiny_prompt(2, 3), 20),
        ("c", tiny_prompt(3, 12), 7),
        ("a", tiny_prompt(4, 4), 1),
        ("b", tiny_prompt(5, 30), 15),
    ]
    expected = [reference_tokens(tiny_model, prompt, adapter, n) for adapter, prompt, n in plan]
    with Engine(tiny_model, config=EngineConfig(max_running=4)) as engine:
        first = engine.submit(plan[0][1], plan[0][0], SamplingParams(max_new_tokens=plan[0][2]))
        next(iter(first))  # the long request is decoding: the others join its batch
        handles = [first] + [
            engine.submit(prompt, adapter, SamplingParams(max_new_tokens=n)) for adapter, prompt, n in plan[1:]
        ]
        completions = [handle.result(timeout=60) for handle in handles]
    for completion, tokens in zip(completions, expected):
        assert list(completion.token_ids) == tokens
        assert completion.finish_reason == "length" and completion.completion_tokens == len(tokens)
    long_request, short_requests = completions[0], completions[1:]
    assert all(c.first_token_at < long_request.finished_at for c in short_requests)  # joined while it ran
    assert any(c.finished_at < long_request.token_times[-2] for c in short_requests)  # left before it ended


def test_key_slots_built_on_the_device_are_transformers_own(tiny_model, monkeypatch):
    """The engine builds each step's key slots from the requests' pages; they must equal the slot lists
    transformers builds itself (chunked prefills, decodes, requests of several pages, joining and leaving)."""
    from punica_hf.serving.transformers_cb import _AdapterSlotIOs

    checked = []
    prepare = _AdapterSlotIOs.prepare_batch_tensors

    def checking_prepare(io, requests_in_batch, *args, **kwargs):
        groups = len(io._page_groups)
        expected_reads, writes = [[] for _ in range(groups)], [[] for _ in range(groups)]
        for future_state in requests_in_batch:
            state = future_state.state
            io.cache.extend_read_and_write_indices(state.request_id, state.position_offset,
                                                   future_state.query_length, expected_reads, writes)
        prepare(io, requests_in_batch, *args, **kwargs)
        if io.max_kv_read:  # steps with cached keys (prefill-only steps read the keys they write)
            built = [io.read_index_storage[g, : io.true_read_sizes[g]].tolist() for g in range(groups)]
            assert built == expected_reads
            checked.append((len(requests_in_batch), sum(len(r) for r in expected_reads)))

    monkeypatch.setattr(_AdapterSlotIOs, "prepare_batch_tensors", checking_prepare)
    cb_config = Engine._cb_config

    def small_pages(engine, device):  # requests of several pages
        config = cb_config(engine, device)
        setattr(config, "page_size" if hasattr(config, "page_size") else "block_size", 16)
        return config

    monkeypatch.setattr(Engine, "_cb_config", small_pages)
    plan = [(adapter, tiny_prompt(40 + i, 3 + 23 * i), 9 + 5 * i) for i, adapter in enumerate(["a", None, "b", "c"] * 2)]
    expected = [reference_tokens(tiny_model, prompt, adapter, n) for adapter, prompt, n in plan]
    config = EngineConfig(max_running=6, max_batch_tokens=64, kv_blocks=64)
    with Engine(tiny_model, config=config) as engine:
        page = engine._backend.page_size
        handles = [engine.submit(prompt, adapter, SamplingParams(max_new_tokens=n)) for adapter, prompt, n in plan]
        completions = [handle.result(timeout=60) for handle in handles]
    assert [list(c.token_ids) for c in completions] == expected
    assert page == 16 and max(requests for requests, _ in checked) == 6 and max(keys for _, keys in checked) > 30 * page


def test_the_engines_attention_reads_the_paged_cache_in_place(tiny_model, monkeypatch):
    """At every layer of every step the attention kernel gets the paged cache's own memory and the step's slot
    lists: no step copies the keys and values it reads out of the cache (transformers' own cache update does, from
    transformers 5.24 on). Prefills, chunked prefills and decodes, tokens still equal ``generate()``'s."""
    from punica_hf import ops

    calls = []  # per kernel call: (key cache memory, value cache memory, slot list memory, keys read, queries)
    paged_attention = ops.paged_attention

    def recording(query, key_cache, value_cache, key_slots, cu_seq_lens_q, cu_seq_lens_k, *args, **kwargs):
        calls.append((key_cache.untyped_storage().data_ptr(), value_cache.untyped_storage().data_ptr(),
                      key_slots.untyped_storage().data_ptr(), int(cu_seq_lens_k[-1]), int(cu_seq_lens_q[-1])))
        return paged_attention(query, key_cache, value_cache, key_slots, cu_seq_lens_q, cu_seq_lens_k, *args,
                               **kwargs)

    monkeypatch.setattr(ops, "paged_attention", recording)
    plan = [(adapter, tiny_prompt(60 + i, 5 + 29 * i), 6 + 3 * i) for i, adapter in enumerate(["a", None, "b", "c"])]
    expected = [reference_tokens(tiny_model, prompt, adapter, n) for adapter, prompt, n in plan]
    with Engine(tiny_model, config=EngineConfig(max_running=4, max_batch_tokens=32)) as engine:
        handles = [engine.submit(prompt, adapter, SamplingParams(max_new_tokens=n)) for adapter, prompt, n in plan]
        completions = [handle.result(timeout=60) for handle in handles]
        cache, io = engine._backend._processor.cache, engine._backend._io
    assert [list(c.token_ids) for c in completions] == expected
    if hasattr(cache, "cache_tensor"):  # transformers >= 5.18: one tensor holds every layer's pages
        cache_memory = {cache.cache_tensor.untyped_storage().data_ptr()}
    else:
        cache_memory = {t.untyped_storage().data_ptr() for t in [*cache.key_cache, *cache.value_cache]}
    slot_memory = {index.untyped_storage().data_ptr() for index in (io.read_index_storage, io.write_index_storage)}
    layers = tiny_model.model.config.num_hidden_layers
    assert len(calls) > 10 * layers and any(keys > 2 * queries for *_, keys, queries in calls)  # decodes ran
    for key_memory, value_memory, slots_memory, *_ in calls:
        assert {key_memory, value_memory} <= cache_memory and slots_memory in slot_memory


def test_padded_steps_are_keyed_by_their_query_count_and_whether_they_run_adapters(tiny_model, monkeypatch):
    """Steps padded to static shapes as under CUDA graphs (run without graphs: a CPU has none). Every step's graph
    key is its padded query count and whether a token of it has an adapter, whatever number of keys it reads: the
    kernel gets slot lists as long as the cache's readable tokens plus the queries, every step. The tokens equal
    ``generate()``'s."""
    from punica_hf import ops
    from punica_hf.serving import transformers_cb

    warm_up = transformers_cb.ContinuousBatchingBackend.warm_up

    def padded(backend):  # steps padded as on a GPU with CUDA graphs on
        backend._runner.pad_inputs = True
        warm_up(backend)

    steps, slot_lists = [], []  # per step: (graph key, padded queries, keys read); per kernel call: (slots, rows)
    prepare = transformers_cb._AdapterSlotIOs.prepare_batch_tensors

    def recording_prepare(io, *args, **kwargs):
        prepare(io, *args, **kwargs)
        steps.append((io._get_graph_key(), (io.num_q_tokens, io.step_has_adapter), io.true_read_sizes[0]))

    paged_attention = ops.paged_attention

    def recording_attention(query, key_cache, value_cache, key_slots, *args, **kwargs):
        slot_lists.append((key_slots.shape[0], query.shape[0]))
        return paged_attention(query, key_cache, value_cache, key_slots, *args, **kwargs)

    monkeypatch.setattr(transformers_cb.ContinuousBatchingBackend, "warm_up", padded)
    monkeypatch.setattr(transformers_cb._AdapterSlotIOs, "prepare_batch_tensors", recording_prepare)
    monkeypatch.setattr(ops, "paged_attention", recording_attention)
    plan = [(adapter, tiny_prompt(70 + i, 4 + 21 * i), 5 + 4 * i) for i, adapter in enumerate(["b", "a", None, "c"])]
    expected = [reference_tokens(tiny_model, prompt, adapter, n) for adapter, prompt, n in plan]
    with Engine(tiny_model, config=EngineConfig(max_running=4, max_batch_tokens=32)) as engine:
        assert engine._backend.graphs_on
        handles = [engine.submit(prompt, adapter, SamplingParams(max_new_tokens=n)) for adapter, prompt, n in plan]
        completions = [handle.result(timeout=60) for handle in handles]
    assert [list(c.token_ids) for c in completions] == expected
    assert all(key == queries_and_adapter for key, queries_and_adapter, _ in steps), steps
    assert len({keys for *_, keys in steps}) > 10  # the steps read many different numbers of keys
    assert len({slots - rows for slots, rows in slot_lists}) == 1, set(slot_lists)


def test_steps_in_which_no_token_has_an_adapter_run_the_base_model_alone(tiny_model, monkeypatch):
    """A step none of whose tokens has an adapter (base requests, an aLoRA request before its invocation) runs the
    wrapped model without adapter slots: no LoRA grouping, no LoRA kernel. A step with one adapter token groups its
    tokens once. The tokens equal ``generate()``'s either way."""
    from punica_hf.layers import LoraContext

    groupings = []
    build = LoraContext.build

    def counting_build(context, token_slots, *args, **kwargs):
        groupings.append(sorted(set(token_slots.tolist())))
        return build(context, token_slots, *args, **kwargs)

    monkeypatch.setattr(LoraContext, "build", counting_build)
    base_plan = [(None, tiny_prompt(90 + i, 5 + 7 * i), 6 + i) for i in range(3)]
    mixed_plan = [(None, tiny_prompt(95, 9), 8), ("b", tiny_prompt(96, 4), 3)]
    expected = [reference_tokens(tiny_model, prompt, adapter, n) for adapter, prompt, n in base_plan + mixed_plan]
    groupings.clear()
    steps = []
    with Engine(tiny_model, config=EngineConfig(max_running=4, max_batch_tokens=32)) as engine:
        engine.add_step_listener(steps.append)
        base = [engine.submit(prompt, adapter, SamplingParams(max_new_tokens=n)) for adapter, prompt, n in base_plan]
        tokens = [list(handle.result(timeout=60).token_ids) for handle in base]
        base_steps = len(steps)
        assert base_steps >= 8 and groupings == []  # every step ran, none grouped tokens by adapter
        mixed = [engine.submit(prompt, adapter, SamplingParams(max_new_tokens=n)) for adapter, prompt, n in mixed_plan]
        tokens += [list(handle.result(timeout=60).token_ids) for handle in mixed]
    assert tokens == expected
    assert groupings and all(any(slot >= 0 for slot in slots) for slots in groupings)  # only steps with "b" tokens
    assert len(groupings) < len(steps) - base_steps  # the base request's steps after "b" ended ran without LoRA
    assert all(step.device_seconds is None for step in steps)  # GPU time: CUDA only


def test_warm_up_captures_every_shape_with_and_without_the_adapter_path(tiny_model, monkeypatch):
    """With graphs on, the warm-up runs each padded query count twice, largest first: once on the adapter path (its
    graph keyed ``(queries, True)``), once on the base model's (``(queries, False)``), so a step of either kind
    replays a graph captured at start. (A CPU captures no graph: the runs go through the same calls.)"""
    from punica_hf.serving import transformers_cb

    warm_up = transformers_cb.ContinuousBatchingBackend.warm_up
    keys = []

    def padded(backend):
        backend._runner.pad_inputs = True
        run_one_warmup = backend._runner.run_one_warmup

        def recording_run(model, num_q_tokens, max_kv_read):
            run_one_warmup(model, num_q_tokens=num_q_tokens, max_kv_read=max_kv_read)
            keys.append(backend._io._get_graph_key())

        monkeypatch.setattr(backend._runner, "run_one_warmup", recording_run)
        warm_up(backend)

    monkeypatch.setattr(transformers_cb.ContinuousBatchingBackend, "warm_up", padded)
    with Engine(tiny_model, config=EngineConfig(max_running=4, max_batch_tokens=96)) as engine:
        assert engine._backend._io.warm_up_adapter_path is False  # the flag is the warm-up's alone
        completion = engine.submit(tiny_prompt(97, 6), "a", SamplingParams(max_new_tokens=4)).result(timeout=60)
    interval = engine._backend._processor.cb_config.q_padding_interval_size
    sizes = sorted({96} | {min(size, 96) for size in range(interval, 96 + interval, interval)}, reverse=True)
    assert keys == [(size, with_adapters) for size in sizes for with_adapters in (True, False)]
    assert len(completion.token_ids) == 4


def test_compiled_steps_give_the_tokens_of_generate(tiny_model, monkeypatch):
    """``EngineConfig(compile_steps=True)``: transformers compiles each step's forward (padded to static shapes, as
    under CUDA graphs; dynamic, so one compile serves every size) with the LoRA ops as opaque calls, as the CUDA
    kernels are to torch.compile: adapter and base requests, mixed and alone, give ``generate()``'s tokens, through
    the compiled function. Every layer's attention (the cache write and the read, one op declaring what it writes)
    is in the graph: no graph break, so the whole forward is one graph per path (with and without adapters) for
    every step size up to 256 tokens (above, the LoRA calls of grouped projections split: one more), and the cache
    it writes in place is the one the next step reads. The engine decides the LoRA ops before it compiles: decided
    in the compiled forward, finding the kernels breaks the graph (then Dynamo compiles every layer apart, up to its
    limit, and the engine took minutes to start on the GPU)."""
    from opaque_kernels import route_to_opaque_kernels
    from torch._dynamo.utils import counters

    plan = [(adapter, tiny_prompt(150 + i, 3 + 9 * i), 4 + 2 * i) for i, adapter in enumerate(["a", None, "c", "b"])]
    expected = [reference_tokens(tiny_model, prompt, adapter, n) for adapter, prompt, n in plan]
    route_to_opaque_kernels(tiny_model, monkeypatch, decided=False)
    torch._dynamo.reset()
    counters.clear()
    config = EngineConfig(max_running=4, max_batch_tokens=192, compile_steps=True)
    with Engine(tiny_model, config=config) as engine:
        assert engine._backend.graphs_on  # compiled steps run padded
        handles = [engine.submit(prompt, adapter, SamplingParams(max_new_tokens=n)) for adapter, prompt, n in plan]
        completions = [handle.result(timeout=300) for handle in handles]
    torch._dynamo.reset()
    assert [list(c.token_ids) for c in completions] == expected
    assert dict(counters["graph_break"]) == {}
    assert 0 < counters["stats"]["unique_graphs"] <= 2  # the steps ran through compiled code, whole


def test_streamed_pieces_add_up_to_the_completion(demo_model):
    model, answers = demo_model
    with Engine(model, DemoTokenizer()) as engine:
        handle = engine.submit(demo.make_prompt(WORDS[0]), "reverse", SamplingParams(max_new_tokens=12))
        deltas = list(handle)
        completion = handle.result()
    assert "".join(d.text for d in deltas) == completion.text == answers["reverse"][WORDS[0]]
    assert [t for d in deltas for t in d.token_ids] == list(completion.token_ids)
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["stop"]


def test_async_streaming(demo_model):
    model, answers = demo_model

    async def stream(engine):
        handle = engine.submit(demo.make_prompt(WORDS[1]), "upper", SamplingParams(max_new_tokens=12))
        pieces = [delta.text async for delta in handle]
        return pieces, await handle.aresult()

    import asyncio

    with Engine(model, DemoTokenizer()) as engine:
        pieces, completion = asyncio.run(stream(engine))
    assert "".join(pieces) == completion.text == answers["upper"][WORDS[1]]


def test_a_thread_publishing_to_many_async_streams_wakes_their_loop_once_per_round():
    """The engine's thread gives each of 128 streamed requests a piece per step: their event loop is woken once for
    the lot (one write to its wake-up socket), not once per request, and every stream gets every piece, in order."""
    import asyncio

    from punica_hf.serving.handles import RequestHandle
    from punica_hf.serving.types import Completion, Delta

    handles = [RequestHandle(lambda request_id: None, f"r{i}", None, ()) for i in range(128)]
    rounds = 5

    async def main():
        loop = asyncio.get_running_loop()
        wakeups = 0
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            nonlocal wakeups
            wakeups += 1
            return call_soon_threadsafe(*args, **kwargs)

        loop.call_soon_threadsafe = counted
        streams = [asyncio.ensure_future(_texts(handle)) for handle in handles]
        await asyncio.sleep(0.05)  # every stream waits for its first piece

        def engine_thread():
            for step in range(rounds):
                for handle in handles:
                    handle._publish(Delta((step,), f"{step};"))
            for handle in handles:
                handle._publish(None, Completion(handle.request_id, None, (), (), "", "length", rounds, 0.0, None, 1.0))

        worker = threading.Thread(target=engine_thread)
        worker.start()
        texts = await asyncio.gather(*streams)
        worker.join()
        return texts, wakeups

    texts, wakeups = asyncio.run(main())
    assert texts == ["".join(f"{step};" for step in range(rounds))] * len(handles)
    # (rounds + 1) x 128 pieces: the loop is woken a few times per round (each time it has caught up), not per piece
    assert 1 <= wakeups <= len(handles) // 2


def test_an_event_loop_that_streamed_a_request_is_freed_once_it_closes():
    """A caller that runs ``asyncio.run`` per request: every loop it made is freed, none kept by the wake-ups."""
    import asyncio
    import gc
    import weakref

    from punica_hf.serving.handles import RequestHandle
    from punica_hf.serving.types import Completion, Delta

    loops = []
    for number in range(20):
        handle = RequestHandle(lambda request_id: None, f"r{number}", None, ())
        handle._publish(Delta((1,), "x"), Completion(f"r{number}", None, (), (1,), "x", "length", 1, 0.0, None, 1.0))

        async def read(handle=handle):
            loops.append(weakref.ref(asyncio.get_running_loop()))
            return await _texts(handle)

        assert asyncio.run(read()) == "x"
    gc.collect()
    assert [loop for loop in loops if loop() is not None] == []


async def _texts(handle) -> str:
    return "".join([delta.text async for delta in handle])


@pytest.mark.parametrize(
    ("params", "text", "reason"),
    [
        (SamplingParams(max_new_tokens=12, stop=("NI",)), "PU", "stop"),
        (SamplingParams(max_new_tokens=12, stop=("XYZ", "CA")), "PUNI", "stop"),
        (SamplingParams(max_new_tokens=12, stop_token_ids=(ord("I"),)), "PUN", "stop"),
        (SamplingParams(max_new_tokens=3), "PUN", "length"),
        (SamplingParams(max_new_tokens=12, stop=("Q",)), "PUNICA", "stop"),  # EOS before any stop string
    ],
)
def test_stop_strings_stop_tokens_and_max_tokens(demo_model, params, text, reason):
    model, _ = demo_model
    with Engine(model, DemoTokenizer()) as engine:
        handle = engine.submit(demo.make_prompt("punica"), "upper", params)
        streamed = "".join(delta.text for delta in handle)
        completion = handle.result()
        engine.shutdown()
        stats = engine.stats()
    assert (completion.text, completion.finish_reason) == (text, reason)
    assert streamed == text  # the stop string is never streamed, not even in part
    assert stats.running == 0 and stats.kv_free_fraction == 1.0


def test_text_stream_holds_back_a_possible_stop_string():
    stream = TextStream(lambda ids: "".join(map(chr, ids)), stop=["abc"])
    assert stream.add([ord("x"), ord("a")]) == "x"  # "a" could start "abc"
    assert stream.add([ord("b")]) == ""
    assert stream.add([ord("d")]) == "abd"  # it did not
    assert stream.add([ord("a"), ord("b"), ord("c"), ord("z")]) == ""
    assert stream.stopped and stream.text == "xabd" and stream.finish() == ""


def test_text_stream_cost_does_not_grow_with_the_stop_strings():
    """Each new character costs the same however long the stop strings are (a 2 MB one stalled every client)."""
    stream = TextStream(lambda ids: "".join(map(chr, ids)), stop=["x" * 20_000 + "!", "yz"])
    started = time.perf_counter()
    pieces = [stream.add([ord("x")]) for _ in range(50)]
    assert time.perf_counter() - started < 0.25
    assert pieces == [""] * 50  # all of it could be the beginning of the long stop string
    assert stream.add([ord("y")]) == "x" * 50 and stream.add([ord("z")]) == "" and stream.stopped


def test_text_stream_ends_at_the_stop_string_complete_first():
    stream = TextStream(lambda ids: "".join(map(chr, ids)), stop=["abcd", "bc"])
    assert stream.add([ord(c) for c in "abcd"]) == "a"
    assert stream.stopped and stream.text == "a"


@pytest.mark.parametrize("text_bytes", [
    "ok\ufffd".encode(),  # a real U+FFFD at the end
    "ok".encode() + "\u4e2d".encode()[:2],  # a character the token limit cut short
    "\u4e2d\ufffd".encode(),
])
@pytest.mark.parametrize("stop", [(), ("k\ufffd",), ("zz",)])
def test_the_whole_text_is_the_decoded_tokens_even_when_they_end_in_a_replacement_character(text_bytes, stop):
    """The last tokens' text, held back while it ended in U+FFFD (maybe a character cut between tokens), used to
    be dropped when the request ended there: the text fell short of decode(token_ids)."""
    tokenizer = DemoTokenizer()
    ids = list(text_bytes)  # the demo tokenizer's ids are the bytes
    stream = TextStream(tokenizer.decode, stop=stop)
    streamed = "".join(stream.add([token]) for token in ids) + stream.finish()
    whole = tokenizer.decode(ids)
    expected = whole.split(stop[0])[0] if stop and stop[0] in whole else whole
    assert streamed == stream.text == expected


def test_seeded_sampling_is_repeatable_whatever_runs_beside_it(tiny_model):
    prompt = tiny_prompt(10, 6)
    sampled = SamplingParams(max_new_tokens=24, temperature=1.5, seed=1234)
    with Engine(tiny_model, config=EngineConfig(max_running=4)) as engine:
        alone = engine.submit(prompt, "a", sampled).result(timeout=60)
        crowd = [engine.submit(tiny_prompt(20 + i, 5 + i), "b", SamplingParams(max_new_tokens=30)) for i in range(3)]
        crowded = engine.submit(prompt, "a", sampled).result(timeout=60)
        other_seed = engine.submit(prompt, "a", SamplingParams(max_new_tokens=24, temperature=1.5, seed=99))
        top_1 = engine.submit(prompt, "a", SamplingParams(max_new_tokens=24, temperature=1.5, top_k=1, seed=5))
        other_seed, top_1 = other_seed.result(timeout=60), top_1.result(timeout=60)
        [handle.result(timeout=60) for handle in crowd]
    assert alone.token_ids == crowded.token_ids
    assert other_seed.token_ids != alone.token_ids
    assert list(top_1.token_ids) == reference_tokens(tiny_model, prompt, "a", 24)  # top-k 1 is greedy
    assert list(alone.token_ids) != list(top_1.token_ids)


def test_cancel_stops_the_request_and_frees_its_kv_blocks(tiny_model):
    with Engine(tiny_model, config=EngineConfig(max_running=2)) as engine:
        kv_free_idle = engine.stats().kv_free_fraction
        handle = engine.submit(tiny_prompt(30, 40), "b", SamplingParams(max_new_tokens=200))
        stream = iter(handle)
        next(stream)
        assert engine.stats().kv_free_fraction < kv_free_idle  # it holds KV blocks now
        handle.cancel()
        completion = handle.result(timeout=30)
        engine.shutdown()
        stats = engine.stats()
    assert completion.finish_reason == "cancelled" and 0 < completion.completion_tokens < 200
    assert stats.dropped_and_freed == 1 and stats.running == 0
    assert stats.kv_free_fraction == kv_free_idle


def test_more_adapters_than_gpu_slots_wait_for_a_slot_without_holding_the_batch(tiny_adapters):
    model = MultiLoraModel(tiny_base(), max_adapters=1)
    model.load_adapters(tiny_adapters)
    plan = [(adapter, tiny_prompt(70 + i, 4 + i), 12) for i, adapter in enumerate(["a", "b", None, "c", "a", None])]
    expected = [reference_tokens(model, prompt, adapter, n) for adapter, prompt, n in plan]
    evictions_before = model.adapter_stats["evictions"]
    with Engine(model, config=EngineConfig(max_running=4)) as engine:
        handles = [engine.submit(prompt, adapter, SamplingParams(max_new_tokens=n)) for adapter, prompt, n in plan]
        completions = [handle.result(timeout=60) for handle in handles]
    assert [list(c.token_ids) for c in completions] == expected
    a, b, base = completions[0], completions[1], completions[2]
    assert b.first_token_at > a.finished_at  # one slot: b waited for a's requests to give it back
    assert base.first_token_at < a.finished_at  # the base request did not wait
    assert model.adapter_stats["evictions"] > evictions_before


def submit_beside_a_running_request(engine: Engine, submit: Callable[[], list]) -> tuple[list, Completion, Completion]:
    """``submit()``'s handles while a long greedy request decodes (so they share its steps), and that request's
    completion beside them and alone."""
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    alone = engine.submit(demo.make_prompt("batch"), None, params).result(timeout=60)
    anchor = engine.submit(demo.make_prompt("batch"), None, params)
    next(iter(anchor))
    handles = submit()
    return handles, anchor.result(timeout=60), alone


def test_a_request_whose_probabilities_turn_nan_fails_alone(demo_model):
    model, answers = demo_model
    overflowing = SamplingParams(max_new_tokens=12, temperature=1.0, seed=0)
    object.__setattr__(overflowing, "temperature", 1e-300)  # past validation: the engine's own check must hold
    with Engine(model, DemoTokenizer(), EngineConfig(max_running=8)) as engine:
        handles, anchor, alone = submit_beside_a_running_request(engine, lambda: [
            engine.submit(demo.make_prompt(WORDS[0]), "upper", overflowing),
            *(engine.submit(demo.make_prompt(word), "upper", SamplingParams(max_new_tokens=12)) for word in WORDS),
        ])
        failed, *completions = [handle.result(timeout=60) for handle in handles]
        engine.shutdown()
        stats = engine.stats()
    assert anchor.token_ids == alone.token_ids
    assert [c.text for c in completions] == [answers["upper"][word] for word in WORDS]
    assert (failed.finish_reason, failed.error_code) == ("error", GENERATION_FAILED)
    assert "sampling settings turn the scores into NaN or infinite probabilities" in failed.error
    assert stats.dropped_and_freed == 1 and stats.running == 0 and stats.kv_free_fraction == 1.0


def test_an_adapter_with_nan_scores_fails_its_own_requests_only(demo_model, tmp_path):
    _, answers = demo_model
    poison = shutil.copytree(demo.adapter_paths()["upper"], tmp_path / "poison")
    weights = load_file(poison / "adapter_model.safetensors")
    save_file({name: tensor * 1e30 for name, tensor in weights.items()}, poison / "adapter_model.safetensors")
    model = MultiLoraModel(demo.load_base_model(), max_adapters=4)
    model.load_adapters({**demo.adapter_paths(), "poison": poison})
    with Engine(model, DemoTokenizer(), EngineConfig(max_running=8)) as engine:
        attention = engine.hf_model.config._attn_implementation
        if "sdpa" in attention or "eager" in attention:
            pytest.skip(f"{attention} attends over every request of a step behind a mask: 0 * NaN keys poison all")
        handles, anchor, alone = submit_beside_a_running_request(engine, lambda: [
            *(engine.submit(demo.make_prompt(WORDS[0]), "poison", SamplingParams(max_new_tokens=12, **fields))
              for fields in ({}, {"temperature": 1.0})),
            *(engine.submit(demo.make_prompt(word), "reverse", SamplingParams(max_new_tokens=12)) for word in WORDS),
        ])
        failures = [handle.result(timeout=60) for handle in handles[:2]]
        completions = [handle.result(timeout=60) for handle in handles[2:]]
    assert anchor.token_ids == alone.token_ids
    assert [c.text for c in completions] == [answers["reverse"][word] for word in WORDS]
    for failure in failures:
        assert (failure.finish_reason, failure.error_code) == ("error", GENERATION_FAILED)
        assert "NaN or infinite (adapter 'poison')" in failure.error


def test_requests_queued_for_an_unloaded_adapter_fail_naming_it_alone(tiny_adapters):
    model = MultiLoraModel(tiny_base(), max_adapters=len(tiny_adapters))
    model.load_adapters(tiny_adapters)
    with Engine(model, config=EngineConfig(max_running=1)) as engine:
        running = engine.submit(tiny_prompt(90, 5), "a", SamplingParams(max_new_tokens=60))
        next(iter(running))
        started_before = engine.submit(tiny_prompt(91, 5), "b", SamplingParams(max_new_tokens=5))  # holds "b"
        queued = engine.submit(tiny_prompt(92, 5), "b", SamplingParams(max_new_tokens=5))
        deadline = time.monotonic() + 30
        while engine.stats().waiting < 1:  # the first is handed to transformers' scheduler, pinning "b"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert engine.stats().queued == 1  # no room for the second: still in the engine's own queue
        model.unload_adapter("b")
        results = [handle.result(timeout=60) for handle in (running, started_before, queued)]
    assert [r.finish_reason for r in results[:2]] == ["length", "length"]
    failed = results[2]
    assert (failed.finish_reason, failed.error_code) == ("error", ADAPTER_NOT_FOUND)
    assert failed.error == "the adapter 'b' was unloaded before the request started"


def test_a_request_whose_adapter_cannot_be_read_fails_saying_why_and_the_next_reads_it_again(tiny_adapters, tmp_path):
    """An adapter off the device and the host whose source is gone for a moment: its request fails naming the
    read's error (it used to wait in the queue for good), the others are served, and once the source is back a new
    request for the adapter is served."""
    folders = {name: shutil.copytree(path, tmp_path / name) for name, path in tiny_adapters.items()}
    model = MultiLoraModel(tiny_base(), max_adapters=1)
    model.load_adapters(folders)
    plan = [("c", tiny_prompt(95, 5), 6), (None, tiny_prompt(96, 5), 6)]
    expected = [reference_tokens(model, prompt, adapter, n) for adapter, prompt, n in plan]  # leaves "c" resident
    model._store.host.drop(model.adapters["b"])  # "b": on neither tier, read again from its folder at its next use
    away = shutil.move(folders["b"], tmp_path / "away")
    with Engine(model, config=EngineConfig(max_running=4)) as engine:
        failed = engine.submit(tiny_prompt(97, 5), "b", SamplingParams(max_new_tokens=6)).result(timeout=60)
        served = [engine.submit(prompt, adapter, SamplingParams(max_new_tokens=n)) for adapter, prompt, n in plan]
        assert [list(handle.result(timeout=60).token_ids) for handle in served] == expected
        shutil.move(away, folders["b"])
        again = engine.submit(tiny_prompt(97, 5), "b", SamplingParams(max_new_tokens=6)).result(timeout=60)
    assert (failed.finish_reason, failed.error_code) == ("error", GENERATION_FAILED)
    assert re.fullmatch(r"adapter 'b' could not be read from .*/b: (FileNotFoundError|OSError|ValueError): .+",
                        failed.error), failed.error
    assert list(again.token_ids) == reference_tokens(model, tiny_prompt(97, 5), "b", 6)


class HeldTokenizer(DemoTokenizer):
    """Tokenizes once the test lets it: a submit() held halfway, as a long prompt holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.go_on = threading.Event(), threading.Event()

    def encode(self, text: str) -> list[int]:
        self.entered.set()
        assert self.go_on.wait(30)
        return super().encode(text)


@pytest.mark.parametrize("stop", ["shutdown", "engine error"])
def test_a_request_submitted_while_the_engine_stops_is_refused_or_completed(demo_model, stop):
    """submit() checked that the engine runs, tokenized, then queued: an engine that stopped in between (shut down,
    or its thread failed) left the request queued with nobody to run it, and its result() waited for good."""
    model, _ = demo_model
    tokenizer = HeldTokenizer()
    engine = Engine(model, tokenizer, EngineConfig(max_running=2)).start()
    outcome = {}

    def submit() -> None:
        try:
            outcome["handle"] = engine.submit("punica=", params=SamplingParams(max_new_tokens=3))
        except EngineClosedError as error:
            outcome["refused"] = error

    client = threading.Thread(target=submit)
    client.start()
    assert tokenizer.entered.wait(30)
    if stop == "shutdown":
        engine.shutdown(drain=True, timeout=30)
    else:
        def fail(record):
            raise RuntimeError("a listener broke")  # the engine thread stops on it

        engine.add_step_listener(fail)
        first = engine.submit([1, 2, 3], params=SamplingParams(max_new_tokens=3)).result(timeout=30)
        assert first.finish_reason == "error" and not engine.running
    tokenizer.go_on.set()
    client.join(30)
    if "refused" in outcome:
        assert "the engine stopped while the request was being checked" in str(outcome["refused"])
    else:  # accepted: it must end
        assert outcome["handle"].result(timeout=30).finish_reason in ("length", "stop", "error")
    engine.shutdown(timeout=30)


def test_a_cancel_that_comes_as_the_request_ends_does_not_stop_a_later_request_of_the_same_id(tiny_model):
    """A client cancels while its request's last token is on its way, sees the request end, and submits again under
    the same id before the engine's next pass: the stale cancel used to stay behind and cancel the new request."""
    engine = Engine(tiny_model, config=EngineConfig(max_running=2))
    on_output, retried = engine._on_output, {}

    def cancelled_as_it_ends(request_id: str, generated: list[int], finished: bool) -> None:
        if not (finished and request_id == "job-1" and not retried):
            return on_output(request_id, generated, finished)
        engine._requests[request_id].handle.cancel()  # the client's cancel, racing the last token
        on_output(request_id, generated, finished)  # the request ends ...
        retried["handle"] = engine.submit(  # ... and the client, told so, retries at once
            tiny_prompt(98, 4), None, SamplingParams(max_new_tokens=3), request_id="job-1")

    engine._on_output = cancelled_as_it_ends
    with engine:
        beside = engine.submit(tiny_prompt(99, 4), None, SamplingParams(max_new_tokens=12))  # steps go on
        first = engine.submit(tiny_prompt(98, 4), None, SamplingParams(max_new_tokens=3), request_id="job-1")
        assert first.result(timeout=30).finish_reason == "length"
        assert beside.result(timeout=30).finish_reason == "length"
        deadline = time.monotonic() + 30
        while "handle" not in retried:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert retried["handle"].result(timeout=30).finish_reason == "length"


def test_a_cancel_that_arrives_after_its_request_ended_leaves_a_later_namesake_alone(tiny_model):
    """The client's cancel checks that its request is not done, then reaches the engine; a thread preempted between
    the two arrives once the request ended and a new one holds the id. The cancel is for the old request: the new
    one runs to its end."""
    with Engine(tiny_model, config=EngineConfig(max_running=2)) as engine:
        first = engine.submit(tiny_prompt(96, 4), None, SamplingParams(max_new_tokens=3), request_id="job")
        assert first.result(timeout=30).finish_reason == "length"
        second = engine.submit(tiny_prompt(97, 4), None, SamplingParams(max_new_tokens=8), request_id="job")
        ended, first._completion = first._completion, None  # cancel() checks "not done" as before the end ...
        first.cancel()  # ... and reaches the engine only now
        first._completion = ended
        assert second.result(timeout=30).finish_reason == "length"
        assert len(second.result().token_ids) == 8


def test_a_new_request_under_a_cancelled_ones_id_gets_only_its_own_tokens(tiny_model):
    """A client cancels, sees its request end and resubmits under the same id while the engine still holds the
    cancelled request's last step output: that output used to reach the new request (its tokens, then its own
    first tokens skipped). The new request is submitted the moment the old one is released."""
    prompt = tiny_prompt(95, 5)
    expected = reference_tokens(tiny_model, prompt, "b", 6)
    engine = Engine(tiny_model, config=EngineConfig(max_running=4))
    release, retried = engine._release, {}

    def release_then_resubmit(request) -> None:
        release(request)
        if request.request_id == "job" and request.handle.done and not retried:
            retried["handle"] = engine.submit(prompt, "b", SamplingParams(max_new_tokens=6), request_id="job")

    engine._release = release_then_resubmit
    with engine:
        beside = engine.submit(tiny_prompt(94, 4), None, SamplingParams(max_new_tokens=40))  # steps go on
        old = engine.submit(tiny_prompt(93, 6), "a", SamplingParams(max_new_tokens=40), request_id="job")
        pieces = iter(old)
        next(pieces), next(pieces)  # it is decoding
        old.cancel()
        assert old.result(timeout=30).finish_reason == "cancelled"
        deadline = time.monotonic() + 30
        while "handle" not in retried:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        new = retried["handle"].result(timeout=30)
        assert (new.finish_reason, list(new.token_ids), new.completion_tokens) == ("length", expected, 6)
        assert beside.result(timeout=30).finish_reason == "length"


def test_a_completion_listener_that_raises_costs_no_request_its_end(tiny_model):
    """Listeners observe (metrics, logs): one that raises on a completion used to leave that request held (its
    adapter pinned), drop the outputs of the others that finished in the same step (their handles never ended),
    fail a request still running with the listener's error, and hang a draining shutdown."""
    engine = Engine(tiny_model, config=EngineConfig(max_running=4))
    told = []

    def listener(completion: Completion) -> None:
        told.append(completion.request_id)
        raise RuntimeError("the metrics backend is down")

    engine.add_listener(listener)
    with engine:
        together = [engine.submit(tiny_prompt(90 + i, 4), adapter, SamplingParams(max_new_tokens=4))
                    for i, adapter in enumerate(["a", "b"])]  # they finish in the same step
        longer = engine.submit(tiny_prompt(92, 4), None, SamplingParams(max_new_tokens=12))
        completions = [handle.result(timeout=30) for handle in [*together, longer]]
    assert [c.finish_reason for c in completions] == ["length"] * 3
    assert sorted(told) == sorted(c.request_id for c in completions)
    assert not engine._requests and engine.error is None
    assert all(tiny_model._store.lookup(name).users == 0 for name in ("a", "b"))  # no lease left held


def test_a_request_whose_tokens_cannot_be_decoded_fails_alone(tiny_model):
    """A tokenizer whose decode raises for one request's tokens: that request ends with an error naming it, the
    others of the same steps get their text, and the engine goes on."""
    class Fragile(DemoTokenizer):
        def decode(self, token_ids):
            if token_ids and token_ids[0] == poison:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
            return super().decode(token_ids)

    prompts = [tiny_prompt(80 + i, 4) for i in range(4)]
    firsts = [reference_tokens(tiny_model, prompt, None, 1)[0] for prompt in prompts]
    distinct = [i for i, first in enumerate(firsts) if firsts.count(first) == 1]
    assert distinct, "no prompt with a first token of its own"
    poisoned = distinct[0]
    poison = firsts[poisoned]
    with Engine(tiny_model, Fragile(), EngineConfig(max_running=4)) as engine:
        handles = [engine.submit(prompt, None, SamplingParams(max_new_tokens=6)) for prompt in prompts]
        completions = [handle.result(timeout=30) for handle in handles]
        after = engine.submit(prompts[(poisoned + 1) % 4], None, SamplingParams(max_new_tokens=3))
        assert after.result(timeout=30).finish_reason == "length"
    failed = completions[poisoned]
    assert failed.finish_reason == "error" and failed.error_code == GENERATION_FAILED
    assert "could not be handed out" in failed.error and "invalid start byte" in failed.error
    assert [c.finish_reason for i, c in enumerate(completions) if i != poisoned] == ["length"] * 3
    assert not engine._requests


def test_outputs_after_one_whose_delivery_raised_wait_for_the_next_delivery():
    """The step's outputs are handed out in order; one whose callback raises must not take the later ones with it
    (a request that finished in that step would never end)."""
    from types import SimpleNamespace

    from punica_hf.serving.transformers_cb import _OutputRouter

    delivered = []

    def on_tokens(request_id: str, generated: list[int], finished: bool) -> None:
        if request_id == "r2" and not delivered.count("raised"):
            delivered.append("raised")
            raise RuntimeError("a callback broke")
        delivered.append((request_id, finished))

    router = _OutputRouter(on_tokens, lambda request_id, error: delivered.append((request_id, str(error))))
    router.deliver_batch([
        SimpleNamespace(request_id=f"r{i}", error=None, generated_tokens=[i], is_finished=lambda: True)
        for i in range(1, 4)
    ])
    router.deliver(SimpleNamespace(request_id="r4", error="out of memory"))
    router.deliver_pending({"r3"})  # a cancelled request's, before it is released: the others stay kept
    assert delivered == [("r3", True)]
    with pytest.raises(RuntimeError, match="a callback broke"):
        router.deliver_pending()
    router.deliver_pending()
    assert delivered == [("r3", True), ("r1", True), "raised", ("r4", "out of memory")]


def test_a_request_queued_while_its_adapter_is_reloaded_under_its_name_fails_as_unloaded(tiny_adapters):
    """Unloading "b" and loading another adapter as "b" while a request for "b" waits in the queue: it used to start
    with the new weights, an adapter its client never asked for. It fails as a request of an unloaded adapter does."""
    model = MultiLoraModel(tiny_base(), max_adapters=1)
    model.load_adapters({"a": tiny_adapters["a"], "b": tiny_adapters["b"]})
    with Engine(model, config=EngineConfig(max_running=4)) as engine:
        running = engine.submit(tiny_prompt(90, 5), "a", SamplingParams(max_new_tokens=60))
        next(iter(running))  # "a" holds the one slot
        queued = engine.submit(tiny_prompt(92, 5), "b", SamplingParams(max_new_tokens=5))
        deadline = time.monotonic() + 30
        while engine.stats().queued < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        model.unload_adapter("b")
        model.load_adapters({"b": tiny_adapters["c"]})
        failed = queued.result(timeout=60)
        later = engine.submit(tiny_prompt(92, 5), "b", SamplingParams(max_new_tokens=5)).result(timeout=60)
        assert running.result(timeout=60).finish_reason == "length"
    assert (failed.finish_reason, failed.error_code) == ("error", ADAPTER_NOT_FOUND)
    assert failed.error == "the adapter 'b' was unloaded before the request started"
    assert list(later.token_ids) == reference_tokens(model, tiny_prompt(92, 5), "b", 5)  # the new "b"


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_engine_serves_each_architecture_as_generate_does(arch, tmp_path):
    """Every architecture the README lists, with its four adapters and the base model side by side. OPT's forward
    asks the cache for its length at every step, which transformers' paged cache lacks: each of its requests used
    to fail."""
    base, paths = make_base_and_adapters(arch, tmp_path)
    model = MultiLoraModel(base, max_adapters=len(paths), max_rank=8)
    model.load_adapters(paths)
    prompts = [torch.randint(1, 90, (3 + i,), generator=torch.Generator().manual_seed(120 + i)).tolist()
               for i in range(len(paths) + 1)]  # within every architecture's vocabulary of 96
    plan = [(adapter, prompt, 5) for adapter, prompt in zip([*paths, None], prompts)]
    expected = [reference_tokens(model, prompt, adapter, n) for adapter, prompt, n in plan]
    with Engine(model, config=EngineConfig(max_running=len(plan))) as engine:
        handles = [engine.submit(prompt, adapter, SamplingParams(max_new_tokens=n)) for adapter, prompt, n in plan]
        completions = [handle.result(timeout=60) for handle in handles]
    assert [(c.finish_reason, list(c.token_ids)) for c in completions] == [("length", t) for t in expected]


def test_submit_all_queues_every_request_or_none(tiny_model):
    """A server's request with several prompts is queued whole: a bad last prompt (or too little room for all)
    used to leave the earlier ones queued, then cancelled, counted as finished and timed."""
    finished = []
    with Engine(tiny_model, config=EngineConfig(max_running=1, max_queue=3)) as engine:
        engine.add_listener(finished.append)
        good = (tiny_prompt(60, 4), "a", SamplingParams(max_new_tokens=2))
        with pytest.raises(ValueError, match="the prompt is empty"):
            engine.submit_all([good, good, ([], None, None)])
        with pytest.raises(QueueFullError):
            engine.submit_all([good] * 4)
        with pytest.raises(ValueError, match="request id 'x' is in use"):
            engine.submit_all([good, good], request_ids=["x", "x"])
        stats = engine.stats()
        assert (stats.queued, stats.rejected, sum(stats.finished.values()), finished) == (0, 1, 0, [])
        handles = engine.submit_all([good, (tiny_prompt(61, 3), None, SamplingParams(max_new_tokens=2))])
        assert [h.result(timeout=30).finish_reason for h in handles] == ["length", "length"]
    assert len(finished) == 2


def test_the_queue_is_bounded(tiny_model):
    config = EngineConfig(max_running=1, max_queue=2)
    with Engine(tiny_model, config=config) as engine:
        accepted, refused = [], 0
        for i in range(6):
            try:
                accepted.append(engine.submit(tiny_prompt(40 + i, 4), None, SamplingParams(max_new_tokens=40)))
            except QueueFullError:
                refused += 1
        assert refused > 0 and len(accepted) <= config.max_queue + config.max_running
        completions = [handle.result(timeout=60) for handle in accepted]
    assert all(c.finish_reason == "length" for c in completions)


def test_shutdown_drains_the_requests_in_flight(tiny_model):
    engine = Engine(tiny_model).start()
    handles = [
        engine.submit(tiny_prompt(50 + i, 6), TINY_ADAPTERS[i % 3], SamplingParams(max_new_tokens=10)) for i in range(5)
    ]
    engine.shutdown(drain=True, timeout=60)
    assert [handle.result(timeout=0).finish_reason for handle in handles] == ["length"] * 5
    with pytest.raises(EngineClosedError):
        engine.submit([1, 2, 3])


def test_shutdown_without_drain_cancels(tiny_model):
    engine = Engine(tiny_model).start()
    handle = engine.submit(tiny_prompt(60, 6), "a", SamplingParams(max_new_tokens=200))
    next(iter(handle))
    engine.shutdown(drain=False, timeout=60)
    assert handle.result(timeout=0).finish_reason == "cancelled"


def test_a_bounded_drain_fails_what_it_could_not_finish_and_frees_its_kv(tiny_model):
    """``shutdown(drain_seconds=...)``: requests that finish within it end as usual; those still running or queued
    then fail with ``SHUT_DOWN`` (a caller can answer them: nothing ends silently), and the engine stops soon
    after, its KV blocks all free. A second thread shutting down at the same time returns too."""
    config = EngineConfig(max_running=2, max_queue=8)
    engine = Engine(tiny_model, config=config).start()
    short = engine.submit(tiny_prompt(70, 5), "a", SamplingParams(max_new_tokens=2))
    long = [engine.submit(tiny_prompt(71 + i, 5), TINY_ADAPTERS[i % 3],
                          SamplingParams(max_new_tokens=240)) for i in range(5)]
    assert short.result(timeout=60).finish_reason == "length"
    next(iter(long[0]))  # running: one token out
    other = threading.Thread(target=engine.shutdown, kwargs={"timeout": 60})  # no bound of its own
    started = time.monotonic()
    other.start()
    engine.shutdown(timeout=60, drain_seconds=0.1)
    other.join(60)
    assert not other.is_alive() and time.monotonic() - started < 30
    ends = [handle.result(timeout=0) for handle in long]
    assert {(c.finish_reason, c.error_code) for c in ends} == {("error", SHUT_DOWN)}, ends
    assert all("requests in flight ran out" in c.error for c in ends) and ends[0].completion_tokens >= 1
    stats = engine.stats()
    assert stats.running == stats.queued == 0 and stats.finished["error"] == 5
    with pytest.raises(EngineClosedError):
        engine.submit([1, 2, 3])
    engine.shutdown(drain_seconds=0)  # again: nothing left to do


def test_an_engine_shut_down_before_it_started_does_not_start(tiny_model):
    """An engine shut down before it started must not start after: nothing would shut down the engine it ran."""
    engine = Engine(tiny_model)
    engine.shutdown(drain_seconds=5)
    with pytest.raises(RuntimeError, match="the engine was shut down"):
        engine.start()
    assert not engine.running


def test_a_shutdown_while_the_engine_starts_stops_it_and_gives_the_model_back(tiny_model, monkeypatch):
    """A shutdown from another thread that comes while ``start()`` builds the batch processor (it found no engine
    thread to stop): the start fails, no engine thread runs, and the model has its attention implementation back."""
    engine = Engine(tiny_model)
    attention_before = engine.hf_model.config._attn_implementation
    decide = tiny_model.decide_backends

    def decide_then_shut_down():
        decide()
        threading.Thread(target=engine.shutdown, kwargs={"drain_seconds": 5}).start()
        time.sleep(0.5)  # the shutdown is done before start() goes on

    monkeypatch.setattr(tiny_model, "decide_backends", decide_then_shut_down)
    with pytest.raises(RuntimeError, match="the engine was shut down while it started"):
        engine.start()
    assert not engine.running and engine._thread is None
    assert engine.hf_model.config._attn_implementation == attention_before


def test_a_second_engine_over_a_served_model_is_refused_until_the_first_shuts_down(tiny_model, monkeypatch):
    """Two engines over one model: the first one's shutdown gave the model back its own attention under the second,
    which then served other tokens with no error. Now the second refuses to start, naming why, and the first serves
    on; once it has shut down another engine starts (also after a start that failed)."""
    prompt, params = tiny_prompt(90, 5), SamplingParams(max_new_tokens=8)
    attention_before = tiny_model.model.config._attn_implementation
    with Engine(tiny_model) as first:
        expected = first.submit(prompt, None, params).result(timeout=60).token_ids
        second = Engine(tiny_model)
        with pytest.raises(RuntimeError, match="another engine serves this model: shut it down before"):
            second.start()
        assert not second.running and first.running
        assert first.submit(prompt, None, params).result(timeout=60).token_ids == expected
    assert tiny_model.model.config._attn_implementation == attention_before

    def fail(*args, **kwargs):
        raise RuntimeError("the batch processor failed")

    with monkeypatch.context() as patch:
        patch.setattr(tiny_model, "fuse_norms", fail)
        with pytest.raises(RuntimeError, match="the batch processor failed"):
            Engine(tiny_model).start()
    with Engine(tiny_model) as third:
        assert third.submit(prompt, None, params).result(timeout=60).token_ids == expected


@pytest.mark.parametrize("drain_seconds", [-1, math.inf, math.nan, True, "5"])
def test_a_bad_drain_bound_is_refused_before_anything_stops(tiny_model, drain_seconds):
    engine = Engine(tiny_model).start()
    try:
        with pytest.raises(ValueError, match="drain_seconds must be a number of seconds"):
            engine.shutdown(drain_seconds=drain_seconds)
        assert engine.running
        assert engine.submit(tiny_prompt(80, 4), None, SamplingParams(max_new_tokens=2)).result(timeout=60)
    finally:
        engine.shutdown(timeout=60)


def test_bad_requests_are_refused_by_name(demo_model, tiny_model):
    model, _ = demo_model
    with Engine(model, DemoTokenizer()) as engine:
        with pytest.raises(KeyError, match="unknown adapter 'nope'"):
            engine.submit("lora=", "nope")
        with pytest.raises(ValueError, match="exceeds the 64-token limit"):
            engine.submit("x" * 60, None, SamplingParams(max_new_tokens=10))
        with pytest.raises(ValueError, match="prompt is empty"):
            engine.submit([])
        with pytest.raises(ValueError, match=r"integers in \[0, 259\)"):
            engine.submit([1, 300])
        assert engine.stats().queued == 0
    class AddedTokens(DemoTokenizer):  # a token added to the tokenizer past the model's embedding rows
        def encode(self, text: str) -> list[int]:
            return [300 if character == "~" else token for character, token in zip(text, super().encode(text))]

    with Engine(model, AddedTokens()) as engine:
        with pytest.raises(ValueError, match=r"tokenizer turned the prompt into token ids outside .* \[0, 259\), "
                                             r"got \[300\]"):
            engine.submit("lora~=")  # it used to be queued, and fail its step with every request beside it
        assert engine.stats().queued == 0
        assert engine.submit("lora=", "upper", SamplingParams(max_new_tokens=4)).result(timeout=30).finish_reason
    with Engine(tiny_model) as engine:
        with pytest.raises(ValueError, match="needs a tokenizer"):
            engine.submit("text")
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            engine.submit([1, 2], None, SamplingParams(stop=("x",)))
    for bad in (dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-1), dict(stop=("",)),
                dict(temperature=1e-300), dict(temperature=5e-5), dict(seed=2**64)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    SamplingParams(temperature=1e-4, seed=-(2**63))  # the smallest accepted


def test_request_ids_never_collide_and_are_short_strings(tiny_model):
    """A caller's id shaped like an automatic one does not block later plain submissions; an id that is not a
    non-empty string of at most MAX_REQUEST_ID_LENGTH characters is refused by name and changes nothing."""
    with Engine(tiny_model) as engine:
        running = SamplingParams(max_new_tokens=200)
        named = [engine.submit([1, 2], params=running, request_id=f"req-{i}") for i in range(3)]
        plain = [engine.submit([1, 2], params=running) for _ in range(3)]
        assert len({handle.request_id for handle in named + plain}) == 6
        before = engine.stats()
        for bad in (5, b"x", "", "x" * (MAX_REQUEST_ID_LENGTH + 1)):
            with pytest.raises(ValueError, match="request_id must be a non-empty string"):
                engine.submit([1, 2], request_id=bad)
        engine.submit([1, 2], request_id="x" * MAX_REQUEST_ID_LENGTH).cancel()  # the longest accepted
        assert engine.stats().rejected == before.rejected
        for handle in named + plain:
            handle.cancel()
            assert handle.result(timeout=60).finish_reason in ("cancelled", "length")


def test_a_graph_capture_that_fails_at_warm_up_stops_start(tiny_model, monkeypatch):
    """transformers' warm-up logs a failed capture and goes on; the engine checks every capture itself, refuses to
    start, and gives the model its attention back. (A CPU cannot capture CUDA graphs: every capture fails here.)"""
    from punica_hf.serving import transformers_cb

    warm_up = transformers_cb.ContinuousBatchingBackend.warm_up

    def with_graphs_on(backend):  # as on a GPU with CUDA graphs on
        backend._runner.pad_inputs = backend._runner.use_cuda_graph_varlen = True
        warm_up(backend)

    monkeypatch.setattr(transformers_cb.ContinuousBatchingBackend, "warm_up", with_graphs_on)
    before = tiny_model.model.config._attn_implementation
    engine = Engine(tiny_model, config=EngineConfig(max_running=4, max_batch_tokens=64))
    with pytest.raises(RuntimeError, match=r"CUDA graph warm-up failed: no graph for 64 tokens per step \(with "
                                           r"adapters\): .*"
                                           "a KV cache of .* blocks and 64 tokens per step"):
        engine.start()
    assert not engine.running and tiny_model.model.config._attn_implementation == before


def test_a_compiled_step_that_fails_at_warm_up_says_how_to_run_uncompiled(tiny_model, monkeypatch):
    """A step compiled with ``compile_steps=True`` that fails at warm-up (a compiler error, say) stops the start
    with an error that names the compiled step and the setting that runs it uncompiled."""
    def failing_compile(*args, **kwargs):
        def compiled(*args, **kwargs):
            raise RuntimeError("the compiler gave up")
        return compiled

    monkeypatch.setattr(torch, "compile", failing_compile)
    engine = Engine(tiny_model, config=EngineConfig(max_running=4, max_batch_tokens=64, compile_steps=True))
    with pytest.raises(RuntimeError, match=r"warm-up of the compiled step failed: .*the compiler gave up.*"
                                           r"compile_steps=False\), or --compile-steps off, runs it uncompiled"):
        engine.start()
    assert not engine.running


def test_submit_from_many_threads(demo_model):
    model, answers = demo_model
    results = {}

    def client(adapter):
        for word in WORDS[:3]:
            handle = engine.submit(demo.make_prompt(word), adapter, SamplingParams(max_new_tokens=12))
            results[adapter, word] = handle.result(timeout=60).text

    with Engine(model, DemoTokenizer()) as engine:
        threads = [threading.Thread(target=client, args=(adapter,)) for adapter in DEMO_ADAPTERS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert results == {(a, w): answers[a][w] for a in DEMO_ADAPTERS for w in WORDS[:3]}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replays_follow_each_steps_adapters(tiny_adapters, tmp_path):
    """Steps replayed from CUDA graphs captured at start read every step's slots, including those of an adapter
    registered after the capture that targets modules no other adapter does."""
    late = save_peft_adapter(tiny_base(), tmp_path / "late", seed=9, r=4, lora_alpha=8,
                             target_modules=["o_proj", "gate_proj"])
    model = MultiLoraModel(tiny_base().to("cuda"), max_adapters=4)
    model.load_adapters({**tiny_adapters, "late": late})
    adapters = ["a", None, "late", "b", "c"]
    plan = [(adapter, tiny_prompt(80 + i, 3 + 2 * i), 16 + i) for i, adapter in enumerate(adapters)]
    expected = [reference_tokens(model, prompt, adapter, n) for adapter, prompt, n in plan]
    model.unload_adapter("late")
    config = EngineConfig(max_running=8, max_batch_tokens=128, kv_blocks=16, cuda_graphs=True)
    with Engine(model, config=config) as engine:
        model.load_adapters({"late": late})
        handles = [engine.submit(prompt, adapter, SamplingParams(max_new_tokens=n)) for adapter, prompt, n in plan]
        completions = [handle.result(timeout=120) for handle in handles]
    assert [list(c.token_ids) for c in completions] == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_base_and_adapter_steps_replay_graphs_captured_at_start(tmp_path):
    """On the paged kernel, steps with no adapter token and steps with one each replay a graph captured at start
    (none is captured while requests wait), give the greedy tokens (up to bf16 rounding), and report the forward's
    GPU time."""
    model = bf16_model_on_the_paged_kernel(tmp_path, seed=5)
    base_plan = [(None, tiny_prompt(130 + i, 3 + 25 * i), 8 + i) for i in range(3)]
    mixed_plan = [(adapter, tiny_prompt(140 + i, 4 + 23 * i), 6 + 2 * i) for i, adapter in enumerate(["a", None, "b"])]
    steps = []
    config = EngineConfig(max_running=8, max_batch_tokens=256, kv_blocks=64, cuda_graphs=True)
    with Engine(model, config=config) as engine:
        captured = engine.stats().cuda_graphs
        assert captured >= 4 and captured % 2 == 0  # each query count with and without the adapter path
        engine.add_step_listener(steps.append)
        completions = []
        for plan in (base_plan, mixed_plan):
            handles = [engine.submit(prompt, adapter, SamplingParams(max_new_tokens=n)) for adapter, prompt, n in plan]
            completions += [handle.result(timeout=120) for handle in handles]
        assert engine.stats().cuda_graphs == captured
    assert_greedy_up_to_rounding(model, base_plan + mixed_plan, completions)
    assert steps and all(0 < step.device_seconds <= step.seconds for step in steps)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_paged_attention_kernel_serves_what_generate_gives(tmp_path):
    """A bf16 model with 64-wide heads runs on punica_hf's paged attention kernel inside CUDA graphs: prefills
    (chunked), decodes and mixed steps of requests with different adapters and lengths. The two paths attend with
    different kernels, so bf16 rounding may flip a near tie: every token the engine picks must be the greedy
    choice of the model's own forward over the same tokens, up to a rounding margin of the scores' spread."""
    from punica_hf.serving import attention

    model = bf16_model_on_the_paged_kernel(tmp_path, seed=3)
    plan = [(adapter, tiny_prompt(120 + i, 2 + 37 * i), 12 + 3 * i) for i, adapter in enumerate(["a", None, "b"] * 3)]
    config = EngineConfig(max_running=8, max_batch_tokens=256, kv_blocks=64)
    with Engine(model, config=config) as engine:
        assert engine.attention.implementation == attention.NAME
        handles = [engine.submit(prompt, adapter, SamplingParams(max_new_tokens=n)) for adapter, prompt, n in plan]
        completions = [handle.result(timeout=120) for handle in handles]
        assert engine._backend.graphs_on  # the steps ran padded, replayed from graphs
    assert_greedy_up_to_rounding(model, plan, completions)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_steps_are_captured_at_start_and_serve_the_greedy_tokens(tmp_path):
    """``compile_steps=True`` on the GPU: every step shape is compiled, whole (the CUDA kernels and the paged
    attention inside, no graph break), and captured at start (no capture while requests run), and each token the
    engine picks is the greedy choice of the model's own forward, up to bf16 rounding (the compiled code fuses and
    rounds differently)."""
    from torch._dynamo.utils import counters

    model = bf16_model_on_the_paged_kernel(tmp_path, seed=4)
    torch._dynamo.reset()
    counters.clear()
    plan = [(adapter, tiny_prompt(160 + i, 2 + 29 * i), 10 + 3 * i) for i, adapter in enumerate(["a", None, "b"] * 3)]
    config = EngineConfig(max_running=8, max_batch_tokens=256, kv_blocks=64, compile_steps=True)
    with Engine(model, config=config) as engine:
        captured = engine.stats().cuda_graphs
        assert engine._backend._runner._compiled_varlen is not None and captured > 0
        handles = [engine.submit(prompt, adapter, SamplingParams(max_new_tokens=n)) for adapter, prompt, n in plan]
        completions = [handle.result(timeout=300) for handle in handles]
        assert engine.stats().cuda_graphs == captured
    # Compiled once per path (with and without the LoRA kernels), not once per shape: a path may compile a second
    # time as its shapes turn dynamic (an H100 run compiled 3 graphs for the 2 paths of 4 padded query counts).
    assert dict(counters["graph_break"]) == {} and 0 < counters["stats"]["unique_graphs"] <= min(4, captured - 1)
    assert_greedy_up_to_rounding(model, plan, completions)


def bf16_model_on_the_paged_kernel(tmp_path, seed: int) -> MultiLoraModel:
    """A tiny bf16 Llama on the GPU with 64-wide heads (the paged kernel's size) and two rank-8 adapters "a", "b"."""
    base = tiny_llama(seed=seed, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      intermediate_size=512, max_position_embeddings=512)
    base.generation_config.eos_token_id = None
    adapters = {name: save_peft_adapter(base, tmp_path / name, seed=i, r=8, lora_alpha=16,
                                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])
                for i, name in enumerate(["a", "b"])}
    model = MultiLoraModel(base.to("cuda", torch.bfloat16), max_adapters=2)
    model.load_adapters(adapters)
    return model


def assert_greedy_up_to_rounding(model, plan, completions) -> None:
    """Each token of each completion is the greedy choice of the model's own forward over the same tokens, up to a
    rounding margin of the scores' spread (bf16 kernels that differ may flip a near tie)."""
    for (adapter, prompt, n), completion in zip(plan, completions):
        tokens = list(completion.token_ids)
        assert len(tokens) == n
        with torch.no_grad():
            scores = model(torch.tensor([prompt + tokens], device="cuda"), adapter_ids=[adapter]).logits[0].float()
        scores = scores[len(prompt) - 1 : -1]  # [n, V]: the scores each engine token was chosen from
        chosen = scores.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
        margin = scores.max(dim=1).values - chosen
        assert (margin <= 0.05 * scores.std(dim=1)).all(), (adapter, len(prompt), margin.tolist())


def test_a_layer_whose_cache_the_engines_attention_cannot_read_fails_its_step_saying_so(tiny_model):
    """A paged cache layer with no plain keys and values (transformers 5.25's latent caches, say) is not read
    through a table that lacks it: the step fails, naming the layer and what to serve the model with instead,
    and the engine stays up for the next request."""
    with Engine(tiny_model, config=EngineConfig(max_running=2, max_batch_tokens=64)) as engine:
        layer_caches = engine._backend._processor.cache.layer_caches
        held = layer_caches.pop(1)
        failed = engine.submit(tiny_prompt(5, 4), "a", SamplingParams(max_new_tokens=2)).result(timeout=60)
        layer_caches[1] = held
        served = engine.submit(tiny_prompt(5, 4), "a", SamplingParams(max_new_tokens=2)).result(timeout=60)
    assert failed.finish_reason == "error"
    assert "layer 1's paged cache holds no plain keys and values" in failed.error and "flash-attn" in failed.error
    assert served.finish_reason == "length" and len(served.token_ids) == 2


def test_each_step_record_counts_the_key_tokens_its_attention_read(tiny_model):
    """``StepRecord.key_tokens``: every request's cached and new tokens at that step (the KV share of its bytes).
    A request of a 6-token prompt and 4 new tokens reads 6 keys at its prefill, then 7, 8 and 9; one of 3 and 4
    reads 3, 4, 5, 6: however the two share steps, the steps' key tokens add up to 48."""
    steps = []
    with Engine(tiny_model, config=EngineConfig(max_running=4, max_batch_tokens=64)) as engine:
        engine.add_step_listener(steps.append)
        handles = [engine.submit(tiny_prompt(seed, length), "a", SamplingParams(max_new_tokens=4, ignore_eos=True))
                   for seed, length in ((11, 6), (12, 3))]
        for handle in handles:
            handle.result(timeout=60)
    assert sum(step.key_tokens for step in steps) == (6 + 7 + 8 + 9) + (3 + 4 + 5 + 6)
    assert all(step.key_tokens >= step.tokens > 0 for step in steps)


def test_compiled_steps_follow_adapters_loaded_and_unloaded_while_serving(tiny_adapters, tmp_path, monkeypatch):
    """A compiled engine (``compile_steps``, the LoRA ops opaque as the CUDA kernels are) serving while an adapter
    on modules no loaded adapter targeted (new hooks), with DoRA vectors, is loaded, then unloaded: each request
    gets ``generate()``'s tokens, before, with and after it (the compiled step recompiles for the new hooks and for
    the vectors that come and go, with no graph break)."""
    from opaque_kernels import route_to_opaque_kernels
    from torch._dynamo.utils import counters

    model = MultiLoraModel(tiny_base(), max_adapters=4)
    model.load_adapters(tiny_adapters)
    wide = save_peft_adapter(tiny_base(), tmp_path / "wide", seed=7, r=4, lora_alpha=8, use_dora=True,
                             target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"])
    phases = [[("a", tiny_prompt(300, 7)), (None, tiny_prompt(301, 5))],
              [("wide", tiny_prompt(302, 6)), ("a", tiny_prompt(303, 4)), (None, tiny_prompt(304, 9))],
              [("b", tiny_prompt(305, 8)), (None, tiny_prompt(306, 3))]]
    model.load_adapters({"wide": wide})  # generate() gives the expected tokens (it cannot run beside the engine)
    expected = [[reference_tokens(model, prompt, adapter, 5) for adapter, prompt in plan] for plan in phases]
    assert expected[1][0] != reference_tokens(model, phases[1][0][1], None, 5)  # "wide" changes its request
    model.unload_adapter("wide")
    route_to_opaque_kernels(model, monkeypatch)
    torch._dynamo.reset()
    counters.clear()
    config = EngineConfig(max_running=4, max_batch_tokens=64, compile_steps=True)
    got = []
    with Engine(model, config=config) as engine:
        for phase, plan in enumerate(phases):
            if phase == 1:
                engine.load_adapters({"wide": wide})
            if phase == 2:
                engine.unload_adapter("wide")
            handles = [engine.submit(prompt, adapter, SamplingParams(max_new_tokens=5)) for adapter, prompt in plan]
            got.append([list(handle.result(timeout=300).token_ids) for handle in handles])
    torch._dynamo.reset()
    assert got == expected
    assert dict(counters["graph_break"]) == {}
