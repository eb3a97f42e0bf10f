"""The engine's batched sampling (``punica_hf.serving.sampling``): transformers' warpers' rules, all rows at once.

Each row's probabilities equal transformers' own warpers (temperature, top-k, top-p) applied to that row alone, ties
and extreme settings included; draws follow the probabilities and never pick a token of probability 0; a seeded row
draws the same token whatever else is in the step; rows whose scores or probabilities are not finite fail alone.
"""

import collections

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from punica_hf.serving import SamplingParams
from punica_hf.serving.sampling import (
    PROBABILITIES_NOT_FINITE, SCORES_NOT_FINITE, RowSampler, _draw, _settings_on, _warped_probabilities, sample_rows,
)

VOCAB = 50
SETTINGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 1, 1.0), (0.5, 0, 0.9), (1.0, 0, 0.01), (2.0, 8, 0.5),
    (1.0, VOCAB + 10, 1.0), (0.9, 3, 0.3), (1e-4, 0, 1.0), (1.0, 0, 0.999), (1.5, 20, 0.95),
]


def sampler(temperature: float, top_k: int, top_p: float, seed: int = 0) -> RowSampler:
    return RowSampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), seed)


def warped(scores: torch.Tensor, samplers: list[RowSampler]) -> torch.Tensor:
    """The engine's probabilities of every row of ``scores`` (row i with ``samplers[i]``)."""
    return _warped_probabilities(scores, _settings_on(scores.device, list(range(len(samplers))), samplers))


def transformers_probabilities(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """One row ``[1, V]`` through transformers' own warpers, in ``generate()``'s order, then softmax."""
    warpers = [TemperatureLogitsWarper(temperature)] if temperature != 1 else []
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    for warper in warpers:
        row = warper(None, row)
    return row.softmax(dim=-1)


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(4))
def test_each_rows_probabilities_are_transformers_warpers_on_that_row_alone(seed, device):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(len(SETTINGS), VOCAB, generator=generator) * 3
    scores[::2] = scores[::2].round()  # ties at the k-th score and in the top-p cut
    samplers = [sampler(*settings) for settings in SETTINGS]
    scores = scores.to(device)  # transformers' warpers on the same device: the same float rounding
    batched = warped(scores, samplers)
    for row, settings in enumerate(SETTINGS):
        expected = transformers_probabilities(scores[row : row + 1], *settings)[0]
        assert torch.equal(batched[row] > 0, expected > 0), settings  # the same tokens kept
        torch.testing.assert_close(batched[row], expected, rtol=1e-5, atol=1e-7, msg=str(settings))


def test_draws_follow_the_probabilities_and_never_pick_an_impossible_token():
    probabilities = torch.tensor([[0.0, 0.1, 0.0, 0.2, 0.3, 0.4, 0.0]] * 4000)
    row_sampler = sampler(1.0, 0, 1.0, seed=3)
    tokens = _draw(probabilities, torch.tensor([row_sampler.uniform() for _ in range(4000)])).tolist()
    counts = collections.Counter(tokens)
    assert set(counts) == {1, 3, 4, 5}
    for token, probability in ((1, 0.1), (3, 0.2), (4, 0.3), (5, 0.4)):
        assert abs(counts[token] / 4000 - probability) < 0.03, (token, counts)
    edges = _draw(probabilities[:3], torch.tensor([1.0, 1e-12, 0.1])).tolist()  # (0, 1]'s ends; a boundary
    assert edges == [5, 1, 1]


@pytest.mark.parametrize("device", DEVICES)
def test_a_seeded_row_draws_the_same_tokens_alone_or_in_a_crowd(device):
    generator = torch.Generator().manual_seed(7)
    steps = [torch.randn(6, VOCAB, generator=generator).to(device) for _ in range(10)]
    alone_sampler = sampler(1.2, 10, 0.9, seed=42)
    alone = [sample_rows(scores[2:3], [alone_sampler]).tokens.item() for scores in steps]
    crowd_samplers = [sampler(0.8, 0, 1.0, seed=1), None, sampler(1.2, 10, 0.9, seed=42), sampler(1.0, 3, 1.0, seed=2),
                      None, sampler(2.0, 0, 0.5, seed=3)]
    crowded = []
    for scores in steps:
        sampled = sample_rows(scores, crowd_samplers)
        assert sampled.rows == [0, 2, 3, 5] and sampled.failures == []
        crowded.append(sampled.tokens[1].item())
    assert crowded == alone
    assert len(set(alone)) > 1  # it samples


def test_rows_with_scores_or_probabilities_that_are_not_finite_fail_alone():
    scores = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    scores[1, 3] = float("nan")  # a greedy row with a NaN
    scores[2, 4] = float("inf")  # a sampling row with an infinity
    scores[3] *= 1e36  # a sampling row whose temperature overflows the scores
    samplers = [sampler(1.0, 0, 1.0), None, sampler(1.0, 0, 1.0), sampler(1e-4, 0, 1.0), sampler(0.9, 4, 0.8)]
    sampled = sample_rows(scores, samplers)
    assert sorted(sampled.failures) == [(1, SCORES_NOT_FINITE), (2, SCORES_NOT_FINITE), (3, PROBABILITIES_NOT_FINITE)]
    assert sampled.rows == [0, 4] and sampled.tokens.shape == (2,)
    top_4 = scores[4].topk(4).indices.tolist()
    assert sampled.tokens[1].item() in top_4


@pytest.mark.parametrize("top_k", [2**24 - 1, 2**24, 2**31, 2**63 - 1, 2**63, 10**30])
def test_a_top_k_past_any_vocabulary_keeps_every_token_and_fails_no_row(top_k):
    """A client's top_k of 2**63 used to wrap to a negative index in the step's settings and fail every row of the
    step, its neighbours' included."""
    scores = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    scores[2] = scores[0]  # row 2: row 0's scores with top-k off
    samplers = [sampler(0.8, top_k, 1.0, seed=5), None, sampler(0.8, 0, 1.0, seed=5)]
    probabilities = warped(scores[[0, 2]], [samplers[0], samplers[2]])
    torch.testing.assert_close(probabilities[0], probabilities[1], rtol=0, atol=0)
    sampled = sample_rows(scores, samplers)
    assert sampled.failures == [] and sampled.rows == [0, 2]
    assert sampled.tokens[0] == sampled.tokens[1]  # the same seed, the same probabilities: the same draw


def test_a_step_without_sampling_rows_only_checks_the_scores():
    scores = torch.randn(3, VOCAB)
    scores[2, 0] = float("-inf")  # one -inf score is fine: the row's best is finite
    sampled = sample_rows(scores, [None, None, None])
    assert sampled.failures == [] and sampled.rows == [] and sampled.tokens.numel() == 0


def test_a_top_p_cut_that_falls_exactly_on_a_boundary_follows_transformers():
    """Four equally likely tokens and top_p 0.5: the cumulative probabilities hit 1 - top_p exactly; transformers
    removes the tokens up to and including that point (two of them), and so does the engine."""
    scores = torch.zeros(1, 4)
    batched = warped(scores, [sampler(1.0, 0, 0.5)])
    expected = transformers_probabilities(scores, 1.0, 0, 0.5)
    assert torch.equal(batched, expected) and (batched > 0).sum() == 2


def test_different_seeds_draw_different_streams_negative_ones_included():
    seeds = (5, -5, 0, 2**63 - 1, -(2**63))
    streams = {seed: [sampler(1.0, 0, 1.0, seed).uniform() for _ in range(3)] for seed in seeds}
    assert len({tuple(stream) for stream in streams.values()}) == len(streams)
    assert [sampler(1.0, 0, 1.0, -5).uniform() for _ in range(3)] == streams[-5]  # and the same seed repeats
