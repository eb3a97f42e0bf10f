"""The engine's public types: a request's settings, the engine's sizing, what a request streams and ends with,
the engine's counters, and its errors. They hold no engine state, so the server and benchmarks import them freely."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

FINISH_REASONS = ("stop", "length", "cancelled", "error")
CPU_MAX_RUNNING = 16  # CPU defaults: transformers would size the cache from free RAM (gigabytes, tens of seconds)
CPU_MAX_BATCH_TOKENS = 256
# Packed tokens per step on a GPU by default: long prefills are split into chunks of this many tokens, so requests
# already decoding wait at most one chunk's forward for their next token, and the graphs' query sizes are bounded.
GPU_MAX_BATCH_TOKENS = 2048
# Smaller temperatures (but 0, greedy) can overflow logits / temperature to infinity: sampling would be NaN.
MIN_TEMPERATURE = 1e-4
# Completion.error_code of a failed request (finish_reason "error"): its adapter was unloaded before it started;
# or its scores were NaN or infinite, its step failed, or the engine stopped.
ADAPTER_NOT_FOUND = "adapter_not_found"
GENERATION_FAILED = "generation_failed"
# Completion.error_code of a request still unfinished when a shutdown's drain time ran out (Engine.shutdown).
SHUT_DOWN = "shut_down"
MAX_REQUEST_ID_LENGTH = 256  # a caller's request id: a non-empty string of at most this many characters

def check_seconds(name: str, value) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is a finite number of seconds >= 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")


class QueueFullError(RuntimeError):
    """The engine's queue holds ``EngineConfig.max_queue`` requests already: retry later."""


class EngineClosedError(RuntimeError):
    """The engine is not running (not started, shutting down, or stopped after an error)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates. ``temperature=0`` is greedy decoding (the same tokens as ``generate()``).

    A temperature between 0 and ``MIN_TEMPERATURE`` is refused (logits / temperature would overflow).
    ``top_k=0`` and ``top_p=1`` turn those filters off; ``seed`` makes sampling repeatable (a random seed
    otherwise). Generation stops after ``max_new_tokens``, at an end-of-sequence token (unless ``ignore_eos``),
    at any of ``stop_token_ids``, or at the first of the ``stop`` strings (left out of the text).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not (
            isinstance(self.temperature, (int, float))
            and (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf)
        ):
            raise ValueError(
                f"temperature must be 0 (greedy) or a number >= {MIN_TEMPERATURE} (smaller ones overflow the "
                f"scores), got {self.temperature!r}"
            )
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64
        ):  # the range torch.Generator.manual_seed takes
            raise ValueError(f"seed must be an integer from -2**63 to 2**64 - 1, got {self.seed!r}")
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class EngineConfig:
    """Sizing of an ``Engine``; ``None`` lets transformers size it from free accelerator memory.

    On the CPU the defaults are small instead: ``CPU_MAX_RUNNING`` requests, ``CPU_MAX_BATCH_TOKENS`` tokens per
    step, and a KV cache that holds ``max_running`` requests of ``max_model_len`` tokens.

    Args:
        max_queue: requests waiting to run at most (submitted, not yet scheduled); one more -> ``QueueFullError``.
        max_running: requests in one batch at most (transformers' ``max_requests_per_batch``).
        max_batch_tokens: packed tokens per step at most (longer prefills are split over steps).
        kv_blocks: blocks of the paged KV cache (each holds a page of tokens for every layer).
        max_model_len: prompt + new tokens of one request at most (default: the model's position limit).
        cuda_graphs: capture each step shape in a CUDA graph (None: transformers decides on a GPU, on for the
            punica_hf attention kernel and flash-attn; never on the CPU).
        warmup: capture the graphs at start instead of on first use.
        prefix_caching: requests with the same prompt prefix and the same adapter (or both none) share its KV pages
            and skip computing it; pages of other adapters never.
        compile_steps: compile each step's forward with ``torch.compile`` (Inductor fuses the norms, rotary
            embeddings, activations and residual adds between the GEMMs; attention and the LoRA kernels run as
            they are), captured in the CUDA graphs as before. Compiling takes minutes at start.
    """

    max_queue: int = 256
    max_running: int | None = None
    max_batch_tokens: int | None = None
    kv_blocks: int | None = None
    max_model_len: int | None = None
    cuda_graphs: bool | None = None
    warmup: bool = True
    prefix_caching: bool = True
    compile_steps: bool = False

    def __post_init__(self) -> None:
        for name in ("max_queue", "max_running", "max_batch_tokens", "kv_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("cuda_graphs", "warmup", "prefix_caching", "compile_steps"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "cuda_graphs" and value is None):
                raise ValueError(f"{name} must be True or False, got {value!r}")

    def batch_limits(self, device_type: str) -> tuple[int | None, int]:
        """(max_running, max_batch_tokens) for a model on ``device_type``, the defaults filled in (None: sized by
        transformers)."""
        if device_type == "cpu":
            return self.max_running or CPU_MAX_RUNNING, self.max_batch_tokens or CPU_MAX_BATCH_TOKENS
        return self.max_running, self.max_batch_tokens or GPU_MAX_BATCH_TOKENS


@dataclass(frozen=True)
class Delta:
    """One streamed piece of a request: its new tokens and their text; ``finish_reason`` on the last piece."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None


@dataclass(frozen=True)
class Completion:
    """A finished request. ``text`` ends before the stop string that stopped it; ``token_ids`` leave out the
    end-of-sequence or stop token that stopped it.

    ``completion_tokens`` counts every token the model generated (a stopping token included); times are
    ``time.perf_counter()`` values. ``finish_reason`` is one of ``FINISH_REASONS``; a failed request (``"error"``)
    has its message in ``error`` and why in ``error_code``: ``ADAPTER_NOT_FOUND``, ``GENERATION_FAILED`` or
    ``SHUT_DOWN``.
    """

    request_id: str
    adapter: str | None
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    completion_tokens: int
    submitted_at: float
    first_token_at: float | None
    finished_at: float
    token_times: tuple[float, ...] = field(repr=False, default=())
    error: str | None = None
    error_code: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def time_per_output_token(self) -> float | None:
        """Mean seconds between output tokens after the first (None with fewer than two)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine. ``queued``: submitted, not yet handed to the scheduler (waiting for room or for
    its adapter); ``waiting``: in the scheduler, not yet started; ``running``: holding KV blocks;
    ``dropped_and_freed``: requests that ended while transformers still ran them (cancelled, client gone, stop
    string, NaN scores) and were dropped with their KV blocks freed; ``rejected``: submissions refused, the queue
    full; ``cuda_graphs``: CUDA graphs captured so far (at start: each step shape with and without the LoRA
    kernels, unless a shape was not known in advance); ``prefix_hit_tokens``: prompt tokens whose KV pages were
    shared from earlier requests of the same adapter."""

    queued: int
    waiting: int
    running: int
    last_batch_requests: int
    last_batch_tokens: int
    steps: int
    prompt_tokens: int
    generated_tokens: int
    finished: dict[str, int]
    dropped_and_freed: int
    rejected: int
    kv_free_fraction: float
    cuda_graphs: int
    prefix_hit_tokens: int


@dataclass(frozen=True)
class StepRecord:
    """One engine step: the requests and packed tokens it ran (``tokens == requests``: a decode step), its
    ``seconds`` from admitting requests to its new tokens in transformers' request states (they reach their
    requests' handles while the next step runs), and ``prepare_seconds`` of those spent before the forward
    (admission, scheduling, building the batch's tensors on the host). ``device_seconds`` (CUDA only, else None):
    the GPU's time from the forward's first kernel to its greedy tokens; the rest of ``seconds`` is the host's work
    the GPU waited for. ``key_tokens``: the tokens whose keys and values the step's attention read, every request's
    cached and new ones (the KV cache's share of the step's bytes)."""

    requests: int
    tokens: int
    seconds: float
    prepare_seconds: float
    device_seconds: float | None = None
    key_tokens: int = 0

