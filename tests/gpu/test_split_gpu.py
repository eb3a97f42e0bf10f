"""Models split across devices by accelerate (issue 11), on one GPU: layers on cuda:0 and on the CPU, and CPU
offload (weights on the CPU, executed on cuda:0). Each must give PEFT's outputs on the same split model, row by row."""

from __future__ import annotations

import pytest
import torch
from accelerate import dispatch_model
from helpers import save_attn_and_mlp_adapters, tiny_llama
from peft import PeftModel

from punica_hf import MultiLoraModel

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

IDS = torch.tensor([[5, 17, 42, 8, 99, 3], [1, 2, 3, 4, 5, 6], [60, 61, 62, 63, 64, 65]])
GREEDY = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
SPLIT = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu", "model.norm": "cpu",
         "model.rotary_emb": "cpu", "lm_head": "cpu"}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return save_attn_and_mlp_adapters(tiny_llama(), tmp_path_factory.mktemp("adapters"))


def split_model(kind: str, tmp_path):
    if kind == "cuda+cpu":  # layer 1 and the head run on the CPU
        return dispatch_model(tiny_llama(), device_map=SPLIT, main_device="cpu")
    # CPU offload: layer 1's weights stay on the CPU and run on cuda:0
    return dispatch_model(tiny_llama(), device_map=SPLIT, main_device=0)


@pytest.mark.parametrize("kind", ["cuda+cpu", "cpu-offload"])
def test_split_model_equals_peft_on_the_same_split(adapters, kind, tmp_path):
    model = MultiLoraModel(split_model(kind, tmp_path), max_adapters=2, max_rank=8)
    model.load_adapters(adapters)
    devices = {pool.device.type for pool in model._store.pools.values()}
    assert devices == ({"cuda", "cpu"} if kind == "cuda+cpu" else {"cuda"})
    ids = IDS.to(0)
    with torch.no_grad():
        logits = model(ids, adapter_ids=["attn", None, "mlp"]).logits
        tokens = model.generate(ids, adapter_ids=["attn", None, "mlp"], **GREEDY)
    for row, name in enumerate(["attn", None, "mlp"]):
        reference = split_model(kind, tmp_path)
        if name is not None:
            reference = PeftModel.from_pretrained(reference, adapters[name]).eval()
        with torch.no_grad():
            torch.testing.assert_close(
                logits[row].cpu(), reference(ids).logits[row].cpu(), rtol=0, atol=2e-4
            )
            assert torch.equal(tokens[row].cpu(), reference.generate(ids, **GREEDY)[row].cpu())
