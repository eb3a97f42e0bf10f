"""Models placed by accelerate's ``device_map`` (issue 11), the parts a CPU-only machine can run: a model
dispatched onto the CPU, and one whose layers are offloaded (weights on 'meta' until accelerate's hook loads them,
executed on the CPU). Each serves per-row adapters exactly like the same model not dispatched (itself equal to
PEFT, tests/test_parity.py). GPU splits (cuda:0 + cpu, CPU offload onto the GPU) are in tests/gpu/test_split_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from accelerate import dispatch_model
from helpers import save_attn_and_mlp_adapters, tiny_llama

from punica_hf import MultiLoraModel

IDS = torch.tensor([[5, 17, 42, 8, 99, 3], [1, 2, 3, 4, 5, 6], [60, 61, 62, 63, 64, 65]])
MIX = ["attn", None, "mlp"]
GREEDY = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
DEVICE_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu", "model.norm": "cpu",
              "model.rotary_emb": "cpu", "lm_head": "cpu"}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return save_attn_and_mlp_adapters(tiny_llama(), tmp_path_factory.mktemp("adapters"))


def served(model, adapters) -> MultiLoraModel:
    wrapped = MultiLoraModel(model, max_adapters=2, max_rank=8)
    wrapped.load_adapters(adapters)
    return wrapped


@pytest.fixture(scope="module")
def expected(adapters):
    model = served(tiny_llama(), adapters)
    with torch.no_grad():
        return model(IDS, adapter_ids=MIX).logits, model.generate(IDS, adapter_ids=MIX, **GREEDY)


@pytest.mark.parametrize("offload", [False, True], ids=["dispatched", "layer-1-offloaded"])
def test_dispatched_models_serve_like_the_plain_one(adapters, expected, offload, tmp_path):
    device_map = dict(DEVICE_MAP, **({"model.layers.1": "disk"} if offload else {}))
    model = dispatch_model(tiny_llama(), device_map=device_map, main_device="cpu", offload_dir=str(tmp_path))
    if offload:
        assert model.model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    wrapped = served(model, adapters)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(IDS, adapter_ids=MIX).logits, expected[0], rtol=0, atol=1e-5)
    assert torch.equal(wrapped.generate(IDS, adapter_ids=MIX, **GREEDY), expected[1])
    static = wrapped.generate(IDS, adapter_ids=MIX, cache_implementation="static", **GREEDY)
    assert torch.equal(static, expected[1])
    (pool,) = wrapped._store.pools.values()
    assert pool.device.type == "cpu"  # the offloaded layer's factors sit on its execution device, not on 'meta'
