"""DoRA and LoRA-bias adapters on a GPU through the CUDA kernels: fp32 equals the CPU path (which equals PEFT,
test_adapter_vectors.py), bf16 is close to PEFT in fp32, and compiled decode, CUDA-graph replays and the engine
apply the vectors as eager forwards do."""

from __future__ import annotations

import copy

import pytest
import torch
from vector_adapters import MODELS, make_base, peft_oracles, save_adapters, save_vector_adapter
from vector_adapters import left_padded_batch, row_lengths

from punica_hf import MultiLoraModel, ops
from punica_hf.serving import Engine, EngineConfig, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _wrapped(base, paths, device, dtype):
    if device == "cuda":  # a failed kernel build would fall back to PyTorch's ops: here it must fail the test
        assert isinstance(ops.backend_for(torch.device(device)), ops.CudaLoraBackend)
    model = MultiLoraModel(copy.deepcopy(base).to(device=device, dtype=dtype), max_adapters=8, max_rank=8)
    model.load_adapters(paths)
    return model


def _rows(paths) -> list[str | None]:
    names = list(paths)
    return [names[0], None, *names[1:], names[0]]


@pytest.mark.parametrize("name", sorted(MODELS))
@torch.no_grad()
def test_gpu_fp32_equals_the_cpu_path_and_bf16_is_close_to_peft(name, tmp_path):
    base = make_base(name)
    paths = save_adapters(name, base, tmp_path)
    rows = _rows(paths)
    input_ids, attention_mask = left_padded_batch(row_lengths(len(rows)))
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    gpu_batch = {key: value.cuda() for key, value in batch.items()}
    real = attention_mask.bool()

    cpu = _wrapped(base, paths, "cpu", torch.float32)
    expected = cpu(**batch, adapter_ids=rows).logits
    gpu = _wrapped(base, paths, "cuda", torch.float32)
    logits = gpu(**gpu_batch, adapter_ids=rows).logits.cpu()
    torch.testing.assert_close(logits[real], expected[real], atol=1e-4, rtol=1e-4)
    kwargs = dict(max_new_tokens=6, do_sample=False)
    expected_tokens = cpu.generate(**batch, adapter_ids=rows, **kwargs)
    assert torch.equal(gpu.generate(**gpu_batch, adapter_ids=rows, **kwargs).cpu(), expected_tokens)

    # bf16 against PEFT in fp32, as close as PEFT's own bf16 forward is (DoRA's scales amplify rounding: random
    # magnitudes put them far from 1)
    half = _wrapped(base, paths, "cuda", torch.bfloat16)
    half_logits = half(**gpu_batch, adapter_ids=rows).logits.float().cpu()
    oracles, half_oracles = peft_oracles(base, paths), peft_oracles(copy.deepcopy(base).to(torch.bfloat16), paths)
    for row, adapter in enumerate(rows):
        peft_logits = oracles[adapter](**batch).logits[row][real[row]]
        peft_half_logits = half_oracles[adapter](**batch).logits[row][real[row]].float()
        error = (half_logits[row][real[row]] - peft_logits).norm() / peft_logits.norm()
        peft_error = (peft_half_logits - peft_logits).norm() / peft_logits.norm()
        assert error < 5e-2 and error < 3 * peft_error + 1e-2, (adapter, error.item(), peft_error.item())


@torch.no_grad()
def test_compiled_decode_and_cuda_graph_replays_apply_the_vectors(tmp_path):
    """Static-cache compiled decode equals eager, also after a DoRA adapter is loaded onto layers that plain LoRA
    hooked before (its vectors are new ops there); a captured forward replays new slots' vectors."""
    base = make_base("llama")
    adapters = MODELS["llama"][1]
    paths = {name: save_vector_adapter(base, tmp_path / name, seed, **adapters[name])
             for seed, name in enumerate(["plain", "dora", "lora_only"])}
    gpu = _wrapped(base, {"plain": paths["plain"]}, "cuda", torch.float32)
    input_ids, attention_mask = left_padded_batch([7, 4, 9, 9, 2, 6])
    input_ids, attention_mask = input_ids.cuda(), attention_mask.cuda()
    kwargs = dict(max_new_tokens=6, do_sample=False, attention_mask=attention_mask)
    for rows in (["plain", None] * 3, ["dora", "plain", None, "lora_only", "dora", "plain"]):
        if "dora" in rows:
            gpu.load_adapters({"dora": paths["dora"], "lora_only": paths["lora_only"]})
        eager = gpu.generate(input_ids, adapter_ids=rows, **kwargs)
        compiled = gpu.generate(input_ids, adapter_ids=rows, cache_implementation="static", **kwargs)
        assert torch.equal(compiled, eager), rows

    names = ["plain", "dora", "lora_only"]
    with gpu.acquire(names) as lease:
        row_slots = torch.full((6,), -1, dtype=torch.int32, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the warm-up PyTorch asks for before a capture
            gpu.model(input_ids=input_ids, adapter_ids=row_slots, use_cache=False)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = gpu.model(input_ids=input_ids, adapter_ids=row_slots, use_cache=False).logits
        for mapping in ([1, -1, 0, 2, 1, 1], [2, 2, 1, -1, 0, 1], [-1] * 6):  # indices into names
            row_slots.copy_(torch.tensor([lease.slots[i] if i >= 0 else -1 for i in mapping]))
            graph.replay()
            expected = gpu.model(input_ids=input_ids, adapter_ids=row_slots, use_cache=False).logits
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_the_engine_serves_vector_adapters_as_generate_does(tmp_path):
    """Steps replayed from CUDA graphs captured with plain LoRA only: DoRA and bias adapters loaded after the
    capture add vector tables to hooked layers, so the engine must capture again; tokens equal generate()'s."""
    base = make_base("llama")
    names = ["plain", "dora", "lora_bias", "lora_only"]
    paths = {name: save_vector_adapter(base, tmp_path / name, seed, **MODELS["llama"][1][name])
             for seed, name in enumerate(names)}
    reference = _wrapped(base, paths, "cuda", torch.float32)
    plan = [(adapter, torch.randint(2, 96, (3 + 2 * i,), generator=torch.Generator().manual_seed(i)).tolist(), 4 + i)
            for i, adapter in enumerate([*names, None, "dora"])]
    expected = [
        reference.generate(torch.tensor([prompt], device="cuda"), adapter_ids=[adapter], max_new_tokens=n,
                           do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        for adapter, prompt, n in plan
    ]
    late = names[1:]
    model = _wrapped(base, {"plain": paths["plain"]}, "cuda", torch.float32)
    config = EngineConfig(max_running=8, max_batch_tokens=128, kv_blocks=16, cuda_graphs=True)
    with Engine(model, config=config) as engine:
        model.load_adapters({name: paths[name] for name in late})
        handles = [engine.submit(prompt, adapter, SamplingParams(max_new_tokens=n)) for adapter, prompt, n in plan]
        completions = [handle.result(timeout=120) for handle in handles]
    assert [list(completion.token_ids) for completion in completions] == expected
