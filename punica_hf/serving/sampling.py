"""The next token of every sampling request of a step, drawn with each request's own settings and random stream.

The step's greedy tokens come from transformers' step, inside the CUDA graphs; a request that samples gets its
token here instead, from its row of the step's scores: temperature, then top-k, then top-p, with the rules of
transformers' warpers (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``: ties at the k-th
score are kept; top-p keeps the smallest set of most likely tokens whose probability exceeds ``top_p``), then one
draw. All the step's sampling rows are warped and drawn together, so a step costs the same few kernels whether
one request samples or a hundred. Each row's draw inverts its cumulative probabilities at a uniform number taken
from the request's own generator on the host (no kernel): a seeded request draws the same tokens whatever else is
in the batch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .types import SamplingParams

SCORES_NOT_FINITE = "the model's scores for it are NaN or infinite"
PROBABILITIES_NOT_FINITE = "its sampling settings turn the scores into NaN or infinite probabilities"
# A top-k at least the vocabulary keeps every token, so larger ones are cut to this: the settings table is float32,
# exact up to 2**24, and a top-k past it (a client's 2**63) would wrap to a negative index and fail the whole step.
TOP_K_CAP = 2**24


class RowSampler:
    """One request's sampling settings and random stream (seeded: the same draws every time)."""

    def __init__(self, params: SamplingParams, seed: int) -> None:
        self.temperature = float(params.temperature)
        self.top_k = min(params.top_k, TOP_K_CAP)
        self.top_p = float(params.top_p)
        self._random = random.Random(seed % 2**64)  # Random takes a seed's absolute value: -5 would draw as 5

    def uniform(self) -> float:
        """The next number of the request's stream, in (0, 1]: never 0, which would pick a token of probability 0."""
        return 1.0 - self._random.random()


@dataclass
class SampledStep:
    """What ``sample_rows`` decided: the rows that cannot get a token, each with why, and the sampled rows with
    their tokens (``tokens`` ``[len(rows)]`` on the scores' device), which replace the step's greedy ones."""

    failures: list[tuple[int, str]]
    rows: list[int]
    tokens: torch.Tensor


def sample_rows(scores: torch.Tensor, samplers: Sequence[RowSampler | None]) -> SampledStep:
    """Check a step's float32 scores ``[R, V]`` (row ``i``'s request samples with ``samplers[i]``, or decodes
    greedily: None) and draw the token of each sampling row. A row fails if its scores hold a NaN or infinity, or
    (sampling) if its warped probabilities do. One copy to the device (the rows' settings), queued behind the step
    without waiting for it, and one wait for the device, for the checks."""
    rows = [row for row, sampler in enumerate(samplers) if sampler is not None]
    # amax is NaN if any score is, +inf if any is, -inf if all are: finite for usable scores only
    checks = [torch.isfinite(scores.amax(dim=-1))]
    if rows:
        settings = _settings_on(scores.device, rows, [samplers[row] for row in rows])
        probabilities = _warped_probabilities(scores.index_select(0, settings.rows), settings)
        checks.append(torch.isfinite(probabilities).all(dim=-1))
        tokens = _draw(probabilities, settings.uniforms)
    else:
        tokens = torch.empty(0, dtype=torch.long, device=scores.device)
    finite = torch.cat(checks).tolist()  # the step's one wait for the device
    scores_finite, probabilities_finite = finite[: len(samplers)], finite[len(samplers) :]
    failures = [(row, SCORES_NOT_FINITE) for row in range(len(samplers)) if not scores_finite[row]]
    kept = []
    for index, row in enumerate(rows):
        if not scores_finite[row]:
            continue
        if not probabilities_finite[index]:
            failures.append((row, PROBABILITIES_NOT_FINITE))
            continue
        kept.append(index)
    if len(kept) < len(rows):
        tokens = tokens[kept]
        rows = [rows[index] for index in kept]
    return SampledStep(failures, rows, tokens)


@dataclass
class _RowSettings:
    """The sampling rows' settings on the device, each ``[S]``: the rows, temperatures, top-k (0: off), top-p
    (1: off), and the rows' uniform numbers for this step's draw; and, from the host, the widest top-k of the rows
    (0: no row limits it) and whether a row limits top-p (the steps that need no sort skip it)."""

    rows: torch.Tensor
    temperatures: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    uniforms: torch.Tensor
    widest_top_k: int
    any_top_p: bool


def _settings_on(device: torch.device, rows: list[int], samplers: list[RowSampler]) -> _RowSettings:
    """The rows' settings in one float32 table (exact for rows and top-k below 2**24), copied to ``device`` from
    pinned memory without waiting: the copy queues behind the step's forward."""
    table = torch.tensor([rows, [s.temperature for s in samplers], [s.top_k for s in samplers],
                          [s.top_p for s in samplers], [s.uniform() for s in samplers]], dtype=torch.float32)
    if device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
    rows_, temperatures, top_k, top_p, uniforms = table
    return _RowSettings(rows_.long(), temperatures, top_k.long(), top_p, uniforms,
                        widest_top_k=max(s.top_k for s in samplers), any_top_p=any(s.top_p < 1 for s in samplers))


def _warped_probabilities(scores: torch.Tensor, settings: _RowSettings) -> torch.Tensor:
    """Each row's probabilities ``[S, V]`` after its temperature, top-k and top-p (transformers' warpers' rules)."""
    scores = scores / settings.temperatures[:, None]
    vocab = scores.shape[-1]
    if settings.widest_top_k:
        top_k = settings.top_k.clamp(max=vocab)
        widest = torch.topk(scores, min(settings.widest_top_k, vocab), dim=-1).values
        kth_scores = widest.gather(1, (top_k - 1).clamp(min=0)[:, None])
        scores = scores.masked_fill((top_k > 0)[:, None] & (scores < kth_scores), -torch.inf)
    if settings.any_top_p:
        ascending, order = torch.sort(scores, dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative <= (1 - settings.top_p)[:, None]
        outside[:, -1] = False  # the most likely token always stays
        outside &= (settings.top_p < 1)[:, None]
        scores = scores.masked_fill(outside.scatter(1, order, outside), -torch.inf)
    return scores.softmax(dim=-1)


def _draw(probabilities: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token of each row ``[S]``: where its cumulative probabilities reach its uniform number (in (0, 1]) times
    their total."""
    cumulative = probabilities.cumsum(dim=-1)
    targets = uniforms.to(cumulative.dtype)[:, None] * cumulative[:, -1:]
    tokens = torch.searchsorted(cumulative, targets)[:, 0]
    return tokens.clamp_(max=probabilities.shape[-1] - 1)
