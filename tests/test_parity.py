"""Mixed batches equal PEFT row by row: logits and generate(), on five architectures.

For every architecture, four PEFT adapters exercising different LoRA features are loaded side by side into
one MultiLoraModel. Each row of a left-padded ragged batch uses its own adapter (or none); the oracle for a
row is PEFT's PeftModel with that row's adapter active on the same batch, and the untouched base model for
rows without adapter.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from architectures import ARCHITECTURES, left_padded_batch, make_base_and_adapters
from peft import PeftModel

from punica_hf import MultiLoraModel

ATOL = 2e-5


@dataclass
class Setup:
    model: MultiLoraModel
    base: torch.nn.Module
    peft: PeftModel
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    row_adapters: list[str | None]


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def setup(request, tmp_path_factory) -> Setup:
    base, paths = make_base_and_adapters(request.param, tmp_path_factory.mktemp(request.param))
    peft = PeftModel.from_pretrained(copy.deepcopy(base), paths["attn"], adapter_name="attn").eval()
    for name in list(paths)[1:]:
        peft.load_adapter(paths[name], adapter_name=name)
    untouched_base = copy.deepcopy(base)
    model = MultiLoraModel(base, max_adapters=6, max_rank=8)
    assert model.load_adapters(paths) == {name: slot for slot, name in enumerate(paths)}

    input_ids, attention_mask = left_padded_batch([7, 4, 9, 9, 2, 6])
    row_adapters = ["attn", None, "all", "mlp_layer1", "regex", "attn"]
    return Setup(model, untouched_base, peft, input_ids, attention_mask, row_adapters)


def _oracle(setup: Setup, adapter: str | None):
    """A callable running PEFT with ``adapter`` active, or the untouched base model for None."""
    if adapter is None:
        return setup.base
    setup.peft.set_adapter(adapter)
    return setup.peft


def _rows_by_adapter(setup: Setup) -> dict[str | None, list[int]]:
    rows: dict[str | None, list[int]] = {}
    for row, adapter in enumerate(setup.row_adapters):
        rows.setdefault(adapter, []).append(row)
    return rows


@torch.no_grad()
def test_mixed_batch_logits_match_peft_row_by_row(setup):
    batch = {"input_ids": setup.input_ids, "attention_mask": setup.attention_mask}
    logits = setup.model(**batch, adapter_ids=setup.row_adapters).logits
    base_logits = setup.base(**batch).logits
    real = setup.attention_mask.bool()
    for adapter, rows in _rows_by_adapter(setup).items():
        expected = _oracle(setup, adapter)(**batch).logits
        for row in rows:
            torch.testing.assert_close(logits[row][real[row]], expected[row][real[row]], atol=ATOL, rtol=0)
            if adapter is not None:  # the adapter really changes this row, so equality above means something
                assert (logits[row][real[row]] - base_logits[row][real[row]]).abs().max() > 1e-3


@torch.no_grad()
def test_indices_and_names_are_the_same_mapping(setup):
    batch = {"input_ids": setup.input_ids, "attention_mask": setup.attention_mask}
    by_name = setup.model(**batch, adapter_ids=setup.row_adapters).logits
    indices = torch.tensor([-1 if a is None else setup.model.adapters[a] for a in setup.row_adapters])
    torch.testing.assert_close(setup.model(**batch, adapter_ids=indices).logits, by_name, atol=0, rtol=0)


GENERATION_MODES = {
    "greedy": dict(do_sample=False),
    "greedy_static_cache": dict(do_sample=False, cache_implementation="static"),
    "beam_search": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    "sampling": dict(do_sample=True, top_k=0, temperature=1.3, num_return_sequences=2),
}


@pytest.mark.parametrize("mode", sorted(GENERATION_MODES))
@torch.no_grad()
def test_generate_matches_peft_row_by_row(setup, mode):
    kwargs = dict(GENERATION_MODES[mode], max_new_tokens=6, attention_mask=setup.attention_mask)
    expand = kwargs.get("num_return_sequences", 1)
    torch.manual_seed(1234)
    generated = setup.model.generate(setup.input_ids, adapter_ids=setup.row_adapters, **kwargs)
    for adapter, rows in _rows_by_adapter(setup).items():
        torch.manual_seed(1234)  # same batch shape and seed: sampling draws the same random numbers per row
        expected = _oracle(setup, adapter).generate(setup.input_ids, **kwargs)
        for row in rows:
            out_rows = slice(row * expand, (row + 1) * expand)
            assert torch.equal(generated[out_rows], expected[out_rows]), f"row {row} ({adapter}) differs"
