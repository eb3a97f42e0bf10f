"""The engine's record of one request, from submission to its completion: its sampling state, the tokens and text
it has streamed so far, and the ``Completion`` it ends with."""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..model import alora_start
from ..store import AdapterLease
from .handles import RequestHandle
from .sampling import RowSampler
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
    sampler: RowSampler | None = None  # sampling requests only: their settings and random stream
    registration: int | None = None  # the load of its adapter it was submitted for (adapter_registration)
    lease: AdapterLease | None = None  # pins the adapter on the GPU from admission to the end
    slot: int = -1
    prefix_key: tuple[str, int] | None = None  # its KV pages' key besides its tokens (None: the base model's)
    seen_tokens: int = 0
    cut_off: str | None = None  # why a shutdown ended it unfinished (its drain time ran out): it fails, not cancels
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)

    @classmethod
    def create(cls, handle: RequestHandle, params: SamplingParams, eos_token_ids: frozenset[int],
               decode: Callable | None) -> RequestState:
        """A new request's state: its stop ids, text stream (``decode``: the tokenizer's, if any) and, when it
        samples, its sampler (seeded by ``params.seed``, or at random)."""
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        sampler = None
        if not params.greedy:
            sampler = RowSampler(params, params.seed if params.seed is not None else random.randrange(2**63))
        return cls(
            handle=handle,
            params=params,
            stop_token_ids=frozenset(stop_ids),
            text=None if decode is None else TextStream(decode, params.stop),
            submitted_at=time.perf_counter(),
            sampler=sampler,
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


def eos_token_ids(hf_model, tokenizer) -> set[int]:
    """The end-of-sequence ids of the model's generation config and the tokenizer."""
    eos = getattr(hf_model.generation_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
    ids.add(getattr(tokenizer, "eos_token_id", None))
    return {i for i in ids if isinstance(i, int) and i >= 0}
