"""Tensor parallelism on a GPU: the CUDA kernels at per-rank widths, and two ranks sharing one GPU.

The kernels: under tensor parallelism each rank's LoRA hooks run on local widths: column-split layers (q, k, v, gate, up) on
``[hidden, out / tp]``, row-split ones (o, down) on ``[in / tp, hidden]``. The 2-rank CPU tests (tests/test_tp.py)
check the placement; this checks the kernels on the shapes a rank of Llama-3-8B / 70B gets at tp 2, 4 and 8, one
process, no collective. The checks are tests/gpu/test_kernels.py's (random pool with NaN gaps, poisoned output).

Two ranks on one GPU (``tp_gpu_worker.py`` under torchrun, gloo carrying the CUDA tensors: NCCL refuses two ranks
on one device): the split model in bf16 with the CUDA backend against the unsplit one, through ``generate`` and
through the serving engine (CUDA graphs off: gloo's collectives cannot be captured).
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import torch
from helpers import save_peft_adapter, tiny_llama
from test_kernels import _assert_matches, _problem, _reference, _run, per_token_path  # noqa: F401 (a fixture)
from two_ranks import check_engines_ran, run_two_ranks

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


WORKER = Path(__file__).with_name("tp_gpu_worker.py")
SPLIT_LAYERS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RUN_TIMEOUT_S = 170
# bf16 keeps 8 bits of mantissa: the split model sums its row-split layers in another order than the whole one.
LOGITS_TOLERANCE = 0.05  # of the largest logit (the CPU run of this harness, in bf16, differs by 0.013)
NEAR_TIE = 2 * LOGITS_TOLERANCE  # of the largest logit: a top-2 gap below this may flip the greedy token


def two_ranks_on_one_device(root: Path, device: str) -> list[dict]:
    """Run tp_gpu_worker.py's 2 ranks on ``device`` ("cuda": GPU 0; "cpu": the harness checked without a GPU)."""
    base = tiny_llama(seed=0)
    base.save_pretrained(root / "model")
    save_peft_adapter(base, root / "adapters" / "attn", r=4, target_modules=["q_proj", "v_proj", "o_proj"], seed=1)
    save_peft_adapter(base, root / "adapters" / "mlp", r=8, target_modules=["gate_proj", "down_proj"], seed=2)
    ranks = run_two_ranks(WORKER, root, RUN_TIMEOUT_S, device, gpus=device == "cuda")
    check_engines_ran(ranks)
    return ranks


def assert_tokens_match(tokens: list[list[int]], expected: list[list[int]], gaps: list[list[float]], scale: float):
    """Row by row, equal tokens; a row may part from the expected one only at a near tie of the unsplit model (then
    both tokens are right to bf16's precision, and the rest of the row follows another prefix)."""
    for row, (got, wanted, row_gaps) in enumerate(zip(tokens, expected, gaps)):
        assert len(got) == len(wanted), row
        parted = next((i for i, (a, b) in enumerate(zip(got, wanted)) if a != b), None)
        if parted is not None:
            assert row_gaps[parted] < NEAR_TIE * scale, (
                f"row {row} differs at token {parted} ({got} vs {wanted}) where the unsplit model's top-2 gap is "
                f"{row_gaps[parted]:.4f}, not a near tie"
            )


@pytest.fixture(scope="module")
def ranks_on_one_gpu(tmp_path_factory) -> list[dict]:
    return two_ranks_on_one_device(tmp_path_factory.mktemp("tp_gpu"), "cuda")


def test_generate_split_over_two_ranks_on_one_gpu_equals_the_unsplit_model(ranks_on_one_gpu):
    leader, follower = ranks_on_one_gpu
    assert leader["split_device"] == follower["split_device"] == "cuda:0"
    # every layer LoRA serves is split; lm_head stays whole (tp_gpu_worker.tp_plan says why)
    assert set(SPLIT_LAYERS) <= set(leader["split_layers"]) and "lm_head" not in leader["split_layers"]
    seen = leader["generate"]
    scale = seen["logits_scale"]
    assert seen["lora_effect"] > 10 * LOGITS_TOLERANCE * scale  # the comparison sees the adapters
    assert seen["logits_difference"] <= LOGITS_TOLERANCE * scale, seen["logits_difference"]
    assert_tokens_match(seen["tokens"], seen["expected_tokens"], seen["gaps"], scale)
    assert follower["generate"]["tokens"] == seen["tokens"]  # every rank generates the same tokens


def test_the_engine_split_over_two_ranks_on_one_gpu_gives_the_unsplit_engines_tokens(ranks_on_one_gpu):
    leader = ranks_on_one_gpu[0]
    split, unsplit = leader["engine"], leader["unsplit_engine"]
    assert split["cuda_graphs"] == 0  # gloo's collectives cannot be captured: the engine keeps graphs off
    assert_tokens_match(split["tokens"], unsplit["tokens"], unsplit["gaps"], leader["generate"]["logits_scale"])
