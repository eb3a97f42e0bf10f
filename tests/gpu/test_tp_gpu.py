"""The CUDA kernels at the per-rank widths of tensor-parallel models, against the float64 reference.

Under tensor parallelism each rank's LoRA hooks run on local widths: column-split layers (q, k, v, gate, up) on
``[hidden, out / tp]``, row-split ones (o, down) on ``[in / tp, hidden]``. The 2-rank CPU tests (tests/test_tp.py)
check the placement; this checks the kernels on the shapes a rank of Llama-3-8B / 70B gets at tp 2, 4 and 8, one
process, no collective. The checks are tests/gpu/test_kernels.py's (random pool with NaN gaps, poisoned output).
"""

from __future__ import annotations

import secrets

import pytest
import torch
from test_kernels import _assert_matches, _problem, _reference, _run, per_token_path  # noqa: F401 (a fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (hidden, k/v width, intermediate) of Llama-3-8B and Llama-3-70B
MODELS = {"8b": (4096, 1024, 14336), "70b": (8192, 1024, 28672)}


def _local_shapes() -> list[tuple[int, int]]:
    """Every distinct ``(in, out)`` a rank's hooks see, over the models and tp 2, 4, 8."""
    shapes = set()
    for hidden, kv_width, intermediate in MODELS.values():
        for tp in (2, 4, 8):
            shapes |= {
                (hidden, hidden // tp), (hidden, kv_width // tp), (hidden, intermediate // tp),  # column-split
                (hidden // tp, hidden), (intermediate // tp, hidden),  # row-split
            }
    return sorted(shapes)


@pytest.mark.parametrize("num_tokens", [1, 64, 300], ids=["decode", "batch", "tiled"])
@pytest.mark.parametrize("shape", _local_shapes(), ids=lambda s: f"{s[0]}x{s[1]}")
def test_lora_add_at_per_rank_widths(shape, num_tokens, per_token_path):
    seed = secrets.randbits(31)
    max_rank = 16  # every slot at full rank: a low rank on one decode token is below bf16's rounding of y
    y, x, pool, (tables,), slots = _problem(num_tokens, *shape, max_rank, 8, "random", "full", torch.bfloat16,
                                            seed)
    y_in = y.clone()
    expected = _reference(y, x, pool, tables, slots, max_rank)
    _run(y, x, pool, tables, slots, max_rank, per_token_path)
    _assert_matches(y, y_in, expected, slots, tables.ranks, torch.bfloat16, f"seed {seed}")
