"""LoRA on ``embed_tokens`` and ``lm_head`` on a GPU, through the CUDA kernels, equals PEFT (the CPU parity is
tests/test_embedding_lora.py): bf16 logits close to PEFT's, float32 logits and greedy tokens equal to them, a
forward captured in a CUDA graph replayed with new slots, a compiled static-cache decode, and the engine."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import save_peft_adapter, tiny_llama
from peft import PeftModel
from test_embedding_lora import BATCHES, LENGTHS, MAX_SLOTS, make_base, left_padded, save_adapters

from punica_hf import MultiLoraModel, ops
from punica_hf.serving import Engine, EngineConfig, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def cuda_kernels_in_use():
    # Under the default backend choice a failed kernel build falls back to PyTorch: that must fail here.
    assert isinstance(ops.backend_for(torch.device("cuda")), ops.CudaLoraBackend)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def adapters(request, tmp_path_factory):
    """``(base on the CPU, float32; PEFT folders)``."""
    base = make_base(tied=request.param)
    return base, save_adapters(base, tmp_path_factory.mktemp("adapters"))


def _wrapped(base, paths, dtype) -> MultiLoraModel:
    model = MultiLoraModel(copy.deepcopy(base).to("cuda", dtype), max_adapters=MAX_SLOTS, max_rank=8)
    model.load_adapters(paths)
    return model


@torch.no_grad()
def _peft_rows(base, paths, rows, input_ids, attention_mask) -> torch.Tensor:
    """Each row's logits from PEFT (float32, CPU) with that row's adapter, or from the base model."""
    logits = base(input_ids, attention_mask=attention_mask).logits.clone()
    for adapter in {a for a in rows if a is not None}:
        peft = PeftModel.from_pretrained(copy.deepcopy(base), paths[adapter]).eval()
        expected = peft(input_ids, attention_mask=attention_mask).logits
        for row in (r for r, a in enumerate(rows) if a == adapter):
            logits[row] = expected[row]
    return logits


@pytest.mark.parametrize("batch", [0, 1])
@torch.no_grad()
def test_bf16_logits_close_to_peft_row_by_row(adapters, batch):
    base, paths = adapters
    rows = BATCHES[batch]
    input_ids, attention_mask = left_padded(LENGTHS, seed=batch)
    expected = _peft_rows(base, paths, rows, input_ids, attention_mask)
    model = _wrapped(base, paths, torch.bfloat16)
    logits = model(input_ids.cuda(), attention_mask=attention_mask.cuda(), adapter_ids=rows).logits.float().cpu()
    base_logits = base(input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    for row, adapter in enumerate(rows):
        error = (logits[row][real[row]] - expected[row][real[row]]).norm()
        assert error < 2e-2 * expected[row][real[row]].norm(), (row, adapter)
        if adapter is not None:  # the adapter's change is far above bf16 rounding
            assert (expected[row][real[row]] - base_logits[row][real[row]]).norm() > 10 * error, (row, adapter)


@torch.no_grad()
def test_fp32_logits_and_greedy_tokens_equal_peft(adapters):
    base, paths = adapters
    model = _wrapped(base, paths, torch.float32)
    for batch, rows in enumerate(BATCHES):
        input_ids, attention_mask = left_padded(LENGTHS, seed=batch)
        expected = _peft_rows(base, paths, rows, input_ids, attention_mask)
        logits = model(input_ids.cuda(), attention_mask=attention_mask.cuda(), adapter_ids=rows).logits.cpu()
        real = attention_mask.bool()
        torch.testing.assert_close(logits[real], expected[real], atol=1e-4, rtol=1e-4)

        kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        tokens = model.generate(input_ids.cuda(), attention_mask=attention_mask.cuda(), adapter_ids=rows, **kwargs)
        for row, adapter in enumerate(rows):
            oracle = base if adapter is None else PeftModel.from_pretrained(copy.deepcopy(base), paths[adapter]).eval()
            expected_tokens = oracle.generate(input_ids, attention_mask=attention_mask, **kwargs)
            assert torch.equal(tokens[row].cpu(), expected_tokens[row]), (row, adapter)


@torch.no_grad()
def test_static_cache_compiled_decode_matches_eager(adapters):
    base, paths = adapters
    model = _wrapped(base, paths, torch.float32)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    for batch, rows in enumerate(BATCHES):
        input_ids, attention_mask = left_padded(LENGTHS, seed=batch)
        input_ids, attention_mask = input_ids.cuda(), attention_mask.cuda()
        eager = model.generate(input_ids, attention_mask=attention_mask, adapter_ids=rows, **kwargs)
        compiled = model.generate(input_ids, attention_mask=attention_mask, adapter_ids=rows,
                                  cache_implementation="static", **kwargs)
        assert torch.equal(compiled, eager), rows


@torch.no_grad()
def test_a_captured_forward_replays_new_slots_on_embeddings_and_kept_positions(adapters):
    """The engine's way: an eager forward captured in a CUDA graph, lm_head on the positions a tensor keeps; every
    replay gives the eager forward's logits for the slots then in the graph's input."""
    base, paths = adapters
    model = _wrapped(base, paths, torch.float32)
    names = ["embed", "head", "both"]
    input_ids = torch.randint(1, base.config.vocab_size, (5, 9), device="cuda")
    kept = torch.tensor([2, 8], device="cuda")
    with model.acquire(names) as lease:
        row_slots = torch.full((5,), -1, dtype=torch.int32, device="cuda")

        def forward():
            return model.model(input_ids=input_ids, adapter_ids=row_slots, use_cache=False, logits_to_keep=kept).logits

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the warm-up PyTorch asks for before a capture
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = forward()
        for mapping in ([0, -1, 1, 2, 0], [2, 2, 1, -1, 0], [-1] * 5):  # indices into names
            row_slots.copy_(torch.tensor([lease.slots[i] if i >= 0 else -1 for i in mapping]))
            graph.replay()
            torch.testing.assert_close(logits, forward(), atol=1e-4, rtol=1e-4)


def test_engine_tokens_equal_generate_with_cuda_graphs(adapters):
    base, paths = adapters
    model = _wrapped(base, paths, torch.float32)
    plan = [
        (adapter, left_padded([length], seed=seed)[0][0].tolist(), new_tokens)
        for seed, (adapter, length, new_tokens) in enumerate(
            [("both", 5, 9), ("plain", 9, 4), ("embed", 3, 12), (None, 12, 6), ("head", 4, 8), ("both", 7, 10)]
        )
    ]
    expected = []
    for adapter, prompt, new_tokens in plan:
        output = model.generate(torch.tensor([prompt], device="cuda"), adapter_ids=[adapter],
                                max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        expected.append(output[0, len(prompt):].tolist())
    config = EngineConfig(max_running=8, max_batch_tokens=128, kv_blocks=16, cuda_graphs=True)
    with Engine(model, config=config) as engine:
        handles = [engine.submit(prompt, adapter, SamplingParams(max_new_tokens=n)) for adapter, prompt, n in plan]
        completions = [handle.result(timeout=120) for handle in handles]
    assert [list(c.token_ids) for c in completions] == expected


@torch.no_grad()
def test_an_output_layer_the_kernels_cannot_take_equals_peft(tmp_path):
    """A vocabulary that is no multiple of 8 (GPT-2's 50257, here 100): lm_head's LoRA runs on PyTorch ops instead
    of the kernels, eagerly and in a captured graph."""
    base = tiny_llama(vocab_size=100)
    targets = {"head": ["lm_head", "v_proj"], "both": ["embed_tokens", "lm_head"]}
    paths = {name: save_peft_adapter(base, tmp_path / name, seed=seed, r=4, lora_alpha=8, target_modules=modules)
             for seed, (name, modules) in enumerate(targets.items())}
    model = _wrapped(base, paths, torch.float32)
    rows = ["head", None, "both", "head"]
    input_ids = torch.randint(1, 100, (4, 7))
    expected = _peft_rows(base, paths, rows, input_ids, torch.ones_like(input_ids))
    torch.testing.assert_close(model(input_ids.cuda(), adapter_ids=rows).logits.cpu(), expected, atol=1e-4, rtol=1e-4)
    with model.acquire(["head", "both"]) as lease:
        slots = torch.tensor([lease.slots[0], -1, lease.slots[1], lease.slots[0]], dtype=torch.int32, device="cuda")
        gpu_ids = input_ids.cuda()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model.model(input_ids=gpu_ids, adapter_ids=slots, use_cache=False, logits_to_keep=1)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model.model(input_ids=gpu_ids, adapter_ids=slots, use_cache=False, logits_to_keep=1).logits
        graph.replay()
        torch.testing.assert_close(logits.cpu(), expected[:, -1:], atol=1e-4, rtol=1e-4)
