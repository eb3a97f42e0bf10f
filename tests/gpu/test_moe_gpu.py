"""LoRA on MoE experts on a GPU: mixed batches of expert, attention and base rows, against the CPU path (which
equals PEFT, test_moe_lora.py) in float32 and against PEFT itself in bfloat16."""

from __future__ import annotations

import copy

import pytest
import torch
from architectures import left_padded_batch
from peft import PeftModel
from test_moe_lora import ROW_ADAPTERS, save_moe_adapters, tiny_qwen3_moe

from punica_hf import MultiLoraModel, ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
BF16_TOLERANCE = 2e-2  # relative error of a row's logits (bf16 rounding, as in test_model_gpu.py)


def _wrapped(base, paths, device, dtype):
    model = MultiLoraModel(copy.deepcopy(base).to(device=device, dtype=dtype), max_adapters=3, max_rank=8)
    model.load_adapters(paths)
    return model


@torch.no_grad()
def test_gpu_moe_logits_and_greedy_tokens_match_cpu(tmp_path):
    # The attention's and the experts' LoRA run on the CUDA kernels (a failed build must fail here).
    assert isinstance(ops.backend_for(torch.device("cuda")), ops.CudaLoraBackend)
    base = tiny_qwen3_moe()
    paths = save_moe_adapters(base, tmp_path)
    cpu = _wrapped(base, paths, "cpu", torch.float32)
    gpu = _wrapped(base, paths, "cuda", torch.float32)
    input_ids, attention_mask = left_padded_batch([7, 4, 9, 9, 2, 6])
    expected = cpu(input_ids=input_ids, attention_mask=attention_mask, adapter_ids=ROW_ADAPTERS).logits
    logits = gpu(input_ids=input_ids.cuda(), attention_mask=attention_mask.cuda(), adapter_ids=ROW_ADAPTERS).logits
    real = attention_mask.bool()
    torch.testing.assert_close(logits.cpu()[real], expected[real], atol=1e-4, rtol=1e-4)

    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected_tokens = cpu.generate(input_ids, attention_mask=attention_mask, adapter_ids=ROW_ADAPTERS, **kwargs)
    tokens = gpu.generate(input_ids.cuda(), attention_mask=attention_mask.cuda(), adapter_ids=ROW_ADAPTERS, **kwargs)
    assert torch.equal(tokens.cpu(), expected_tokens)


@torch.no_grad()
def test_gpu_bf16_moe_rows_close_to_peft(tmp_path):
    base = tiny_qwen3_moe()
    paths = save_moe_adapters(base, tmp_path)
    gpu = _wrapped(base, paths, "cuda", torch.bfloat16)
    untouched = copy.deepcopy(base).to(device="cuda", dtype=torch.bfloat16)
    input_ids, attention_mask = left_padded_batch([7, 4, 9, 9, 2, 6])
    batch = {"input_ids": input_ids.cuda(), "attention_mask": attention_mask.cuda()}
    logits = gpu(**batch, adapter_ids=ROW_ADAPTERS).logits.float()
    base_logits = untouched(**batch).logits.float()
    real = attention_mask.cuda().bool()
    for adapter in set(ROW_ADAPTERS):
        oracle = untouched if adapter is None else PeftModel.from_pretrained(copy.deepcopy(untouched), paths[adapter])
        expected = oracle.eval()(**batch).logits.float()
        for row in [i for i, a in enumerate(ROW_ADAPTERS) if a == adapter]:
            got, want = logits[row][real[row]], expected[row][real[row]]
            error = (got - want).norm() / want.norm()
            assert error < BF16_TOLERANCE, (row, adapter, error)
            if adapter is not None:  # the adapter moves this row far more than the tolerance
                assert (want - base_logits[row][real[row]]).norm() / want.norm() > 3 * BF16_TOLERANCE, (row, adapter)
