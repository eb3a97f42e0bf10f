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


class RowSampler:
    """One request's sampling settings and random stream (seeded: the same draws every time)."""

    def __init__(self, params: SamplingParams, seed: int) -> None:
        self.temperature = float(params.temperature)
        self.top_k = params.top_k
        self.top_p = float(params.top_p)
        self._random = random.Random(seed)

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
    (sampling) if its warped probabilities do. One wait for the device, for the checks."""
    rows = [row for row, sampler in enumerate(samplers) if sampler is not None]
    # amax is NaN if any score is, +inf if any is, -inf if all are: finite for usable scores only
    checks = [torch.isfinite(scores.amax(dim=-1))]
    if rows:
        chosen = [samplers[row] for row in rows]
        probabilities = _warped_probabilities(scores[rows], chosen)
        checks.append(torch.isfinite(probabilities).all(dim=-1))
        tokens = _draw(probabilities, [sampler.uniform() for sampler in chosen])
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


def _warped_probabilities(scores: torch.Tensor, samplers: list[RowSampler]) -> torch.Tensor:
    """Each row's probabilities ``[S, V]`` after its temperature, top-k and top-p (transformers' warpers' rules)."""
    device, vocab = scores.device, scores.shape[-1]
    temperatures = torch.tensor([s.temperature for s in samplers], dtype=scores.dtype, device=device)
    scores = scores / temperatures[:, None]
    top_k = [min(s.top_k, vocab) if s.top_k > 0 else 0 for s in samplers]
    if any(top_k):
        widest = max(top_k)
        kth = torch.tensor([k - 1 if k else widest - 1 for k in top_k], device=device)
        kth_scores = torch.topk(scores, widest, dim=-1).values.gather(1, kth[:, None])
        limited = torch.tensor([k > 0 for k in top_k], device=device)
        scores = scores.masked_fill(limited[:, None] & (scores < kth_scores), -torch.inf)
    top_p = [s.top_p for s in samplers]
    if any(p < 1 for p in top_p):
        ascending, order = torch.sort(scores, dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative <= (1 - torch.tensor(top_p, dtype=scores.dtype, device=device))[:, None]
        outside[:, -1] = False  # the most likely token always stays
        outside &= torch.tensor([p < 1 for p in top_p], device=device)[:, None]
        scores = scores.masked_fill(outside.scatter(1, order, outside), -torch.inf)
    return scores.softmax(dim=-1)


def _draw(probabilities: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """The token of each row ``[S]``: where its cumulative probabilities reach its uniform number times their total."""
    cumulative = probabilities.cumsum(dim=-1)
    targets = torch.tensor(uniforms, dtype=cumulative.dtype, device=cumulative.device)[:, None] * cumulative[:, -1:]
    tokens = torch.searchsorted(cumulative, targets)[:, 0]
    return tokens.clamp_(max=probabilities.shape[-1] - 1)
