"""The engine's record of one request, from submission to its completion: its sampling state, the tokens and text
it has streamed so far, and the ``Completion`` it ends with."""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ..model import alora_start
from ..store import AdapterLease
from .handles import RequestHandle
from .text import TextStream
from .types import Completion, SamplingParams


@dataclass
class RequestState:
    """One request as the engine thread tracks it (the caller holds its ``handle``)."""

    handle: RequestHandle
    params: SamplingParams
    stop_token_ids: frozenset[int]  # end-of-sequence ids (unless ignore_eos) and the request's stop ids
    text: TextStream | None
    submitted_at: float
    generator: torch.Generator | None = None  # sampling requests only
    warpers: tuple = ()
    lease: AdapterLease | None = None  # pins the adapter on the GPU from admission to the end
    slot: int = -1
    prefix_key: tuple[str, int] | None = None  # its KV pages' key besides its tokens (None: the base model's)
    seen_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)

    @classmethod
    def create(cls, handle: RequestHandle, params: SamplingParams, eos_token_ids: frozenset[int],
               decode: Callable | None, device: torch.device) -> RequestState:
        """A new request's state: its stop ids, text stream (``decode``: the tokenizer's, if any) and, when it
        samples, its generator (seeded by ``params.seed``, or at random) and warpers."""
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else random.randrange(2**63)
            generator = torch.Generator(device).manual_seed(seed)
        return cls(
            handle=handle,
            params=params,
            stop_token_ids=frozenset(stop_ids),
            text=None if decode is None else TextStream(decode, params.stop),
            submitted_at=time.perf_counter(),
            generator=generator,
            warpers=_warpers(params) if generator is not None else (),
        )

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    @functools.cached_property
    def adapter_start(self) -> int | None:
        """The first position (prompt and generated tokens in one count) the request's adapter applies to: 0 for
        plain LoRA; for aLoRA, the start of the prompt's last invocation, None where the prompt lacks it (the request
        then runs as the base model, as in PEFT). Read once admitted: it needs the lease."""
        invocation_tokens = None if self.lease is None else self.lease.invocation_tokens[0]
        return alora_start(invocation_tokens, self.handle.prompt_token_ids)

    @property
    def stopped_by_text(self) -> bool:
        return self.text is not None and self.text.stopped

    def take_tokens(self, generated: list[int]) -> tuple[list[int], str, bool]:
        """Take the request's tokens so far (transformers' view): returns the new tokens to stream (a stopping
        token left out), their text, and whether a stop token ended it."""
        new_tokens = generated[self.seen_tokens :]
        self.seen_tokens = len(generated)
        now = time.perf_counter()
        self.token_times.extend([now] * len(new_tokens))
        stopped_by_token = bool(new_tokens) and new_tokens[-1] in self.stop_token_ids
        kept = new_tokens[:-1] if stopped_by_token else new_tokens
        self.token_ids.extend(kept)
        text = self.text.add(kept) if self.text is not None else ""
        return kept, text, stopped_by_token

    def probabilities(self, row_scores: torch.Tensor) -> torch.Tensor:
        """A sampling request's next-token probabilities ``[1, V]`` from its row of the step's scores."""
        for warper in self.warpers:
            row_scores = warper(None, row_scores)
        return row_scores.softmax(dim=-1)

    def finish(self, reason: str, error: str | None = None, error_code: str | None = None) -> tuple[str, Completion]:
        """The text still held back (a possible stop string's start) and the request's completion."""
        tail = self.text.finish() if self.text is not None else ""
        completion = Completion(
            request_id=self.request_id,
            adapter=self.handle.adapter,
            prompt_token_ids=self.handle.prompt_token_ids,
            token_ids=tuple(self.token_ids),
            text=self.text.text if self.text is not None else "",
            finish_reason=reason,
            completion_tokens=self.seen_tokens,
            submitted_at=self.submitted_at,
            first_token_at=self.token_times[0] if self.token_times else None,
            finished_at=time.perf_counter(),
            token_times=tuple(self.token_times),
            error=error,
            error_code=error_code,
        )
        return tail, completion


def _warpers(params: SamplingParams) -> tuple:
    """transformers' own warpers for a sampling request, in ``generate()``'s order."""
    warpers = [TemperatureLogitsWarper(params.temperature)] if params.temperature != 1 else []
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    return tuple(warpers)


def sample_rows(scores: torch.Tensor, row_requests: list[RequestState | None]
                ) -> tuple[list[tuple[RequestState, str]], list[tuple[int, torch.Tensor]]]:
    """Check a step's scores ``[rows, V]`` (row ``i`` is ``row_requests[i]``'s; None: a request the engine has
    forgotten) and draw the token of each sampling request with its own settings and generator. Returns the
    requests that cannot get a token, each with why (NaN or infinite scores or probabilities), and the
    ``(row, token)`` of each sampled token, which replaces the step's greedy one."""
    sampling = [(row, r) for row, r in enumerate(row_requests) if r is not None and not r.params.greedy]
    probabilities = [request.probabilities(scores[row : row + 1]) for row, request in sampling]
    # amax is NaN if any score is, +inf if any is, -inf if all are: finite for usable scores only
    checks = [torch.isfinite(scores.amax(dim=-1))]
    checks += [torch.isfinite(p).all(dim=-1) for p in probabilities]
    finite = torch.cat(checks).tolist()  # the step's one wait for the device
    scores_finite, probabilities_finite = finite[: len(row_requests)], finite[len(row_requests) :]
    failures = [(request, "the model's scores for it are NaN or infinite")
                for row, request in enumerate(row_requests) if request is not None and not scores_finite[row]]
    tokens = []
    for (row, request), probs, usable in zip(sampling, probabilities, probabilities_finite):
        if not scores_finite[row]:
            continue
        if not usable:
            failures.append((request, "its sampling settings turn the scores into NaN or infinite probabilities"))
            continue
        tokens.append((row, torch.multinomial(probs, 1, generator=request.generator)[0, 0]))
    return failures, tokens


def eos_token_ids(hf_model, tokenizer) -> set[int]:
    """The end-of-sequence ids of the model's generation config and the tokenizer."""
    eos = getattr(hf_model.generation_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
    ids.add(getattr(tokenizer, "eos_token_id", None))
    return {i for i in ids if isinstance(i, int) and i >= 0}
