"""Continuous batching in which every request brings its own LoRA adapter and its own generation settings.

Built on transformers' continuous batching (``transformers/generation/continuous_batching``, tested with 5.17 and
5.24): its paged KV cache, scheduler (chunked prefill, offloading when the cache is full), packed ``[1, T]``
batches, attention paths and CUDA graphs do the work. transformers has no per-request adapter and no per-request
sampling, so this module extends it at three points and drives its batch processor from its own loop:

- ``_AdapterSlotIOs``: the batch inputs gain ``adapter_ids`` ``[1, T]``, the GPU slot of each packed token's
  request (-1 = base model and padding), filled in the same walk over the scheduled requests that packs the
  tokens, in a static buffer (CUDA graphs captured once read new values at every replay). The wrapped model's
  ``forward`` takes it to the LoRA layers.
- ``_ScoreKeepingRunner``: greedy decoding stays inside transformers' (graphable) step; the step also copies its
  logits into a static buffer, from which requests that sample draw their token afterwards with their own
  temperature / top-k / top-p and their own seeded generator, so a seeded request gives the same text whatever
  else is in the batch.
- ``_OutputRouter``: each new token goes to its request's handle (streaming text, stop strings and token ids,
  finish reasons), in the engine thread, while the next step runs on the device (see ``Engine._step``).

transformers builds those objects inside its batch processor without a hook to pass other classes, so the engine
switches the class of the two instances to the subclasses above (keeping every reference transformers holds).
Prefix caching (block sharing) is turned off: two requests with the same prompt but different adapters have
different keys and values, and transformers' block hashes know only the tokens.

Adapters are pinned for each request's lifetime through ``MultiLoraModel.acquire(..., block=False)``: a request
whose adapter is still being loaded, or does not fit next to the adapters running requests hold, waits in the
engine's queue while the batch keeps going. The queue is bounded (``QueueFullError``); cancelling a request frees
its KV blocks at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import itertools
import math
import random
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
from transformers.generation.continuous_batching.model_runner import ModelRunner
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ..store import AdapterCapacityError, AdapterLease, AdapterNotReady
from . import attention
from .text import TextStream, Tokenizer, as_tokenizer

logger = logging.getLogger(__name__)
TESTED_TRANSFORMERS = ">=5.17,<5.25"
FINISH_REASONS = ("stop", "length", "cancelled", "error")
CPU_MAX_RUNNING = 16  # CPU defaults: transformers would size the cache from free RAM (gigabytes, tens of seconds)
CPU_MAX_BATCH_TOKENS = 256
IDLE_POLL_SECONDS = 0.002  # how often a request waiting for its adapter to load retries
# Smaller temperatures (but 0, greedy) can overflow logits / temperature to infinity: sampling would be NaN.
MIN_TEMPERATURE = 1e-4
# Completion.error_code of a failed request (finish_reason "error"): its adapter was unloaded before it started;
# or its scores were NaN or infinite, its step failed, or the engine stopped.
ADAPTER_NOT_FOUND = "adapter_not_found"
GENERATION_FAILED = "generation_failed"
# Packed tokens per step on a GPU by default: prefill chunks of 2048 tokens keep an 8B model's mixed steps near
# 0.1 s (requests already decoding wait that long for their next token), and bound the graphs' query sizes.
GPU_MAX_BATCH_TOKENS = 2048
ONE_KV_PADDING = 1 << 40  # a padding interval longer than any cache: every step's slot list padded to the cache


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
    """

    max_queue: int = 256
    max_running: int | None = None
    max_batch_tokens: int | None = None
    kv_blocks: int | None = None
    max_model_len: int | None = None
    cuda_graphs: bool | None = None
    warmup: bool = True

    def __post_init__(self) -> None:
        for name in ("max_queue", "max_running", "max_batch_tokens", "kv_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


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
    has its message in ``error`` and why in ``error_code``: ``ADAPTER_NOT_FOUND`` or ``GENERATION_FAILED``.
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
    full; ``cuda_graphs``: step shapes captured so far (all at start, unless a shape was not known in advance)."""

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


@dataclass(frozen=True)
class StepRecord:
    """One engine step: the requests and packed tokens it ran (``tokens == requests``: a decode step), its
    ``seconds`` from admitting requests to its new tokens in transformers' request states (they reach their
    requests' handles while the next step runs), and ``prepare_seconds`` of those spent before the forward
    (admission, scheduling, building the batch's tensors on the host)."""

    requests: int
    tokens: int
    seconds: float
    prepare_seconds: float


class RequestHandle:
    """A submitted request: iterate it (``for delta in handle`` / ``async for``) to stream its pieces, or wait for
    the ``Completion`` with ``result()`` / ``await aresult()``; ``cancel()`` stops it and frees its KV memory."""

    def __init__(self, engine: Engine, request_id: str, adapter: str | None, prompt_token_ids: tuple[int, ...]):
        self.request_id = request_id
        self.adapter = adapter
        self.prompt_token_ids = prompt_token_ids
        self._engine = engine
        self._deltas: list[Delta] = []
        self._completion: Completion | None = None
        self._condition = threading.Condition()
        self._async_wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    @property
    def done(self) -> bool:
        return self._completion is not None

    def cancel(self) -> None:
        """Stop generating (no-op once finished); the request finishes with reason ``"cancelled"``."""
        if not self.done:
            self._engine._cancel(self.request_id)

    def result(self, timeout: float | None = None) -> Completion:
        with self._condition:
            if not self._condition.wait_for(lambda: self._completion is not None, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
            return self._completion

    async def aresult(self) -> Completion:
        async for _ in self:
            pass
        return self._completion

    def __iter__(self) -> Iterator[Delta]:
        index = 0
        while True:
            with self._condition:
                self._condition.wait_for(lambda: index < len(self._deltas) or self._completion is not None)
                pending, finished = self._deltas[index:], self._completion is not None
            yield from pending
            index += len(pending)
            if finished and index == len(self._deltas):
                return

    async def __aiter__(self) -> AsyncIterator[Delta]:
        loop, woken = asyncio.get_running_loop(), asyncio.Event()
        with self._condition:
            self._async_wakers.append((loop, woken))
        try:
            index = 0
            while True:
                woken.clear()  # before reading: a delta published after this read sets it again
                with self._condition:
                    pending, finished = self._deltas[index:], self._completion is not None
                for delta in pending:
                    yield delta
                index += len(pending)
                if finished and index == len(self._deltas):
                    return
                if not pending:
                    await woken.wait()
        finally:
            with self._condition:
                self._async_wakers.remove((loop, woken))

    # -------------------------------------------------------------- engine side
    def _publish(self, delta: Delta | None, completion: Completion | None = None) -> None:
        with self._condition:
            if delta is not None:
                self._deltas.append(delta)
            if completion is not None:
                self._completion = completion
            self._condition.notify_all()
            wakers = list(self._async_wakers)
        for loop, woken in wakers:
            try:
                loop.call_soon_threadsafe(woken.set)
            except RuntimeError:  # that consumer's event loop is closed: nobody is waiting there any more
                pass


@dataclass
class _Request:
    """The engine's record of one request, from submission to its completion."""

    handle: RequestHandle
    params: SamplingParams
    stop_token_ids: frozenset[int]  # end-of-sequence ids (unless ignore_eos) and the request's stop ids
    text: TextStream | None
    submitted_at: float
    generator: torch.Generator | None = None  # sampling requests only
    warpers: tuple = ()
    lease: AdapterLease | None = None  # pins the adapter on the GPU from admission to the end
    slot: int = -1
    seen_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.handle.request_id


class Engine:
    """Continuous batching over a ``MultiLoraModel``: ``submit`` requests, each with its adapter (or None for the
    base model) and its ``SamplingParams``, from any thread; one engine thread runs the batch.

    ``tokenizer`` (a transformers tokenizer or any object with ``encode``/``decode``) is needed for text prompts,
    streamed text and stop strings; without it prompts are token ids and outputs token ids only. While the engine
    runs it owns the model: transformers may switch its attention implementation to a paged one, restored by
    ``shutdown()``.

        with Engine(model, tokenizer) as engine:
            handle = engine.submit("Hello", adapter="sql", params=SamplingParams(max_new_tokens=32))
            for delta in handle:
                print(delta.text, end="")
    """

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None) -> None:
        self.model = model
        self.hf_model = model.model  # what transformers' continuous batching runs; its forward takes slots
        self.tokenizer: Tokenizer | None = None if tokenizer is None else as_tokenizer(tokenizer)
        self.config = config or EngineConfig()
        text_config = self.hf_model.config.get_text_config()
        self.vocab_size = text_config.vocab_size
        self.eos_token_ids = frozenset(_eos_token_ids(self.hf_model, tokenizer))
        self.max_model_len = min(
            self.config.max_model_len or math.inf, getattr(text_config, "max_position_embeddings", None) or math.inf
        )
        if self.max_model_len == math.inf:
            raise ValueError("the model config has no max_position_embeddings: give EngineConfig(max_model_len=...)")
        self._requests: dict[str, _Request] = {}  # every request not yet finished, by id
        self._queue: deque[_Request] = deque()  # submitted, not yet handed to transformers
        self._lock = threading.Lock()  # guards _queue, _requests (insertions) and _cancels
        self._cancels: set[str] = set()
        self._wake = threading.Event()
        self._accepting = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self._counters = Counter()
        self._finished = Counter()
        self._last_batch = (0, 0)
        self._listeners: list[Callable[[Completion], None]] = []
        self._step_listeners: list[Callable[[StepRecord], None]] = []
        self._manager = None  # transformers' ContinuousBatchingManager and batch processor, made by start()
        self.attention: attention.AttentionChoice | None = None  # the attention path, chosen by start()
        self._saved_attention = []  # the model configs' attention implementations before start()
        self._processor = None
        self._router: _OutputRouter | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Engine:
        """Build transformers' batch processor (and capture CUDA graphs), then start the engine thread."""
        if self._thread is not None:
            raise RuntimeError("the engine was started already")
        device = self.hf_model.device
        self.attention = attention.choose(self.hf_model)
        logger.info("attention: %s (%s)", self.attention.path, self.attention.reason)
        if self.attention.implementation is not None:
            self._saved_attention = attention.install(self.hf_model, self.attention.implementation)
        with torch.inference_mode():
            self._manager = self.hf_model.init_continuous_batching(
                generation_config=self._generation_config(), continuous_batching_config=self._cb_config(device)
            )
            try:
                processor = self._manager._create_batch_processor()
                cb_config = self._manager.continuous_batching_config
                _AdapterSlotIOs.adopt(processor.inputs_and_outputs, self._slot_of,
                                      own_attention=self.attention.implementation == attention.NAME)
                _ScoreKeepingRunner.adopt(processor.model_runner, cb_config.max_requests_per_batch, self.vocab_size)
                self._router = processor.output_router = _OutputRouter(self)
                self._manager.batch_processor = processor
                if self.config.warmup:
                    self._warm_up(processor)
            except BaseException:
                self._restore_attention()
                raise
        self._processor = processor
        self._graphs_layout = self.model.layout_version
        self.max_model_len = min(self.max_model_len, cb_config.num_blocks * _page_size(cb_config))
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="punica-hf-engine", daemon=True)
        self._thread.start()
        return self

    def _warm_up(self, processor) -> None:
        """Capture the CUDA graphs of the step shapes known in advance; a failed capture raises, naming the memory.

        transformers' own warm-up runs one request as long as the whole KV cache: right for its attention paths,
        whose graphs need room for a copy of the cache, but ours reads the cache in place and would attend over
        every slot. Ours captures the largest step first (its memory pool then holds every smaller one), then every
        smaller padded query count, each over one page of cached tokens: where the kernel reads the cache in place
        the graphs are keyed by query count alone, so no step captures a graph while requests wait.
        """
        runner, cb_config = processor.model_runner, processor.cb_config
        failures = _WarmupFailures()
        runner_logger = sys.modules[ModelRunner.__module__].logger
        runner_logger.addHandler(failures)
        try:
            if self.attention.implementation != attention.NAME:
                processor.warmup(self.hf_model)
            elif runner.pad_inputs:  # graphs on
                interval, max_batch_tokens = cb_config.q_padding_interval_size, processor.cache.max_batch_tokens
                last = max_batch_tokens if attention.READS_CACHE_IN_PLACE else cb_config.max_requests_per_batch
                padded = range(interval, last + interval, interval)  # what the runner pads up to, last included
                sizes = {max_batch_tokens} | {min(size, max_batch_tokens) for size in padded}
                for num_q_tokens in sorted(sizes, reverse=True):  # the largest first
                    runner.run_one_warmup(self.hf_model, num_q_tokens=num_q_tokens, max_kv_read=_page_size(cb_config))
        finally:
            runner_logger.removeHandler(failures)
        if failures.messages:
            raise RuntimeError(f"CUDA graph warm-up failed: {failures.messages[0]} ({_memory_report(processor)})")

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; finish the ones in flight (``drain``) or cancel them; stop the engine thread."""
        self._accepting = False
        if not drain:
            with self._lock:
                self._cancels.update(self._requests)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the engine did not stop within {timeout} s")
        self._restore_attention()

    def _restore_attention(self) -> None:
        """Give the model back the attention implementation it had before ``start()``."""
        if self._manager is not None and self._manager._original_attn_impl is not None:
            self.hf_model.set_attn_implementation(self._manager._original_attn_impl)
            self._manager._original_attn_impl = None
        attention.restore(self._saved_attention)
        self._saved_attention = []

    def __enter__(self) -> Engine:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc_info) -> None:
        self.shutdown(drain=exc_info[0] is None)

    @property
    def running(self) -> bool:
        """Whether the engine takes requests (started, not shutting down, no fatal error)."""
        return self._accepting and self._error is None

    @property
    def error(self) -> BaseException | None:
        """The error that stopped the engine thread, if one did."""
        return self._error

    def add_listener(self, listener: Callable[[Completion], None]) -> None:
        """Call ``listener(completion)`` in the engine thread whenever a request finishes (metrics, logs)."""
        self._listeners.append(listener)

    def add_step_listener(self, listener: Callable[[StepRecord], None]) -> None:
        """Call ``listener(record)`` in the engine thread after every step (metrics, benchmarks)."""
        self._step_listeners.append(listener)

    def _tell_step_listeners(self, started: float, prepared: float) -> None:
        if self._step_listeners:
            requests, tokens = self._last_batch
            record = StepRecord(requests, tokens, time.perf_counter() - started, prepared - started)
            for listener in self._step_listeners:
                listener(record)

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        prompt: str | Sequence[int],
        adapter: str | None = None,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> RequestHandle:
        """Queue a request; returns at once. ``prompt`` is text (needs a tokenizer) or token ids.

        Raises ``KeyError`` for an adapter that is not registered, ``ValueError`` for a bad prompt or settings
        (empty, longer than ``max_model_len`` with its new tokens, a token id outside the vocabulary),
        ``QueueFullError`` when the queue is full and ``EngineClosedError`` when the engine is not running.
        """
        params = params or SamplingParams()
        if not self.running:
            raise EngineClosedError(
                "the engine is not running" + (f": it stopped after an error: {self._error}" if self._error else "")
            )
        if adapter is not None and adapter not in self.model.adapters:
            raise KeyError(f"unknown adapter {adapter!r}; registered: {sorted(self.model.adapters)}")
        prompt_ids = self._prompt_ids(prompt)
        if len(prompt_ids) + params.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) exceeds the "
                f"{self.max_model_len}-token limit of this engine"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: give the engine one, or use stop_token_ids")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else random.randrange(2**63)
            generator = torch.Generator(self.hf_model.device).manual_seed(seed)
        with self._lock:
            if len(self._queue) + self._waiting_count() >= self.config.max_queue:
                self._counters["rejected"] += 1
                raise QueueFullError(f"the engine's queue is full ({self.config.max_queue} requests waiting)")
            request_id = request_id or f"req-{next(self._ids)}"
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is in use")
            request = _Request(
                handle=RequestHandle(self, request_id, adapter, tuple(prompt_ids)),
                params=params,
                stop_token_ids=frozenset(stop_ids),
                text=None if self.tokenizer is None else TextStream(self.tokenizer.decode, params.stop),
                submitted_at=time.perf_counter(),
                generator=generator,
                warpers=_warpers(params) if generator is not None else (),
            )
            self._requests[request_id] = request
            self._queue.append(request)
        self._wake.set()
        return request.handle

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        adapters: Sequence[str | None],
        params: SamplingParams | None = None,
    ) -> list[Completion]:
        """Submit every prompt with its adapter and wait for all: the completions in the prompts' order."""
        if len(prompts) != len(adapters):
            raise ValueError(f"{len(prompts)} prompts but {len(adapters)} adapters")
        handles = [self.submit(prompt, adapter, params) for prompt, adapter in zip(prompts, adapters)]
        return [handle.result() for handle in handles]

    def stats(self) -> EngineStats:
        scheduler = None if self._processor is None else self._processor.scheduler
        return EngineStats(
            queued=len(self._queue),
            waiting=self._waiting_count(),
            running=0 if scheduler is None else len(scheduler.active_requests),
            last_batch_requests=self._last_batch[0],
            last_batch_tokens=self._last_batch[1],
            steps=self._counters["steps"],
            prompt_tokens=self._counters["prompt_tokens"],
            generated_tokens=self._counters["generated_tokens"],
            finished={reason: self._finished[reason] for reason in FINISH_REASONS},
            dropped_and_freed=self._counters["dropped_and_freed"],
            rejected=self._counters["rejected"],
            kv_free_fraction=1.0 if scheduler is None else _kv_free_fraction(self._processor.cache),
            cuda_graphs=0 if scheduler is None else len(self._processor.inputs_and_outputs.graphs._storage),
        )

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: give the engine one, or submit token ids")
            prompt_ids = list(self.tokenizer.encode(prompt))
        else:
            prompt_ids = list(prompt)
            bad = [
                t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size
            ]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        return prompt_ids

    def _waiting_count(self) -> int:
        """Requests in transformers' scheduler that have not started yet."""
        return 0 if self._processor is None else len(self._processor.scheduler.waiting_requests)

    def _cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancels.add(request_id)
        self._wake.set()

    def _slot_of(self, request_id: str) -> int:
        """GPU slot of a scheduled request's adapter (-1: base model, or transformers' own warm-up requests)."""
        request = self._requests.get(request_id)
        return -1 if request is None else request.slot

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        if self.hf_model.device.type == "cuda":
            torch.cuda.set_device(self.hf_model.device)
        try:
            with torch.inference_mode():
                while True:
                    started = time.perf_counter()
                    self._admit()
                    cancelled = self._send_cancellations()
                    has_batch = self._processor.prepare_next_batch()  # drops cancelled requests, frees their KV
                    for request in cancelled:
                        self._counters["dropped_and_freed"] += 1
                        if not request.handle.done:
                            self._complete(request, "cancelled")
                        self._release(request)
                    if has_batch:
                        prepared = time.perf_counter()
                        self._step()
                        self._tell_step_listeners(started, prepared)
                        continue
                    self._router.deliver_pending()  # no step to overlap with: the last step's tokens now
                    if self._stop and not self._requests:
                        return
                    self._wake.wait(IDLE_POLL_SECONDS if self._queue else None)
                    self._wake.clear()
        except BaseException as error:  # the batch state is unknown now: fail every request, refuse new ones
            logger.exception("the engine thread stopped")
            self._error = error
            self._router.deliver_pending()
            for request in list(self._requests.values()):
                if not request.handle.done:
                    self._complete(request, "error", error=f"the engine stopped: {error}", error_code=GENERATION_FAILED)
                self._release(request)

    def _admit(self) -> None:
        """Hand queued requests, in order, to transformers' scheduler while it has room, each once its adapter is
        pinned on the GPU. A request whose adapter is still loading waits without holding up the others; once one
        finds every GPU slot pinned, the adapter requests behind it wait too (base requests go on), so the pinned
        adapters drain and it gets its slot."""
        room = self._processor.cb_config.max_requests_per_batch - self._waiting_count()
        slots_full = False
        with self._lock:
            candidates = list(self._queue)
        for request in candidates:
            if room <= 0:
                return
            adapter = request.handle.adapter
            if adapter is not None:
                if slots_full:
                    continue
                try:
                    request.lease = self.model.acquire([adapter], block=False)
                except AdapterNotReady:  # being read in the background: retry at the next step
                    continue
                except AdapterCapacityError:
                    slots_full = True
                    continue
                except Exception as error:
                    self._remove_from_queue(request)
                    if isinstance(error, KeyError):  # unloaded after submission: name it alone, not those loaded
                        message = f"the adapter {adapter!r} was unloaded before the request started"
                        code = ADAPTER_NOT_FOUND
                    else:
                        message, code = f"adapter {adapter!r}: {error}", GENERATION_FAILED
                    self._complete(request, "error", error=message, error_code=code)
                    self._release(request)
                    continue
                request.slot = request.lease.slots[0]
            self._remove_from_queue(request)
            self._manager.add_request(
                list(request.handle.prompt_token_ids),
                request_id=request.request_id,
                max_new_tokens=request.params.max_new_tokens,
                streaming=True,
                eos_token_id=sorted(request.stop_token_ids),
            )
            self._counters["prompt_tokens"] += len(request.handle.prompt_token_ids)
            room -= 1

    def _remove_from_queue(self, request: _Request) -> None:
        with self._lock:
            self._queue.remove(request)

    def _send_cancellations(self) -> list[_Request]:
        """Pass the cancelled requests to transformers; return those it drops at the next ``prepare``."""
        with self._lock:
            cancels, self._cancels = self._cancels, set()
            queued = [r for r in self._queue if r.request_id in cancels]
            for request in queued:
                self._queue.remove(request)
        for request in queued:
            self._complete(request, "cancelled")
            self._release(request)
        handed_over = []
        for request_id in cancels:
            request = self._requests.get(request_id)
            if request is not None and request not in queued:
                self._manager.cancel_request(request_id)
                handed_over.append(request)
        return handed_over

    def _step(self) -> None:
        """One forward over the scheduled requests, then each request's new token."""
        processor, io = self._processor, self._processor.inputs_and_outputs
        layout = self.model.layout_version
        if layout != self._graphs_layout:  # a LoRA hook added since the graphs were captured: capture again
            graphs = getattr(io, "graphs", None)
            if graphs is not None:
                io.graphs = type(graphs)()
            self._graphs_layout = layout
        self._last_batch = (len(io.requests_in_batch), sum(s.query_length for s in io.requests_in_batch))
        try:
            batch_data = io.get_model_kwargs(use_padding=processor.model_runner.pad_inputs)
            processor.model_runner.compute_batch(self.hf_model, batch_data)
            # The last step's tokens go to their requests (text, stop strings, streams) while this one runs on the
            # device: its graph is queued, and the first wait for it is in the check below.
            self._router.deliver_pending()
            self._check_scores_and_sample(io)
            io.retrieve_device_outputs()
        except Exception as error:  # this batch's requests fail; the others and the engine go on
            logger.exception("a batch failed")
            self._router.deliver_pending()
            processor.handle_batch_error(error)
            return
        self._counters["steps"] += 1
        processor.update_batch()

    def _check_scores_and_sample(self, io) -> None:
        """Fail each request whose scores (or, sampling, whose probabilities) are NaN or infinite, alone: the
        others in the batch keep their tokens. Then replace the greedy token of each sampling request by one drawn
        with its own settings and generator."""
        row_requests = [self._requests.get(f.state.request_id) for f in io.requests_in_batch if f.has_new_token]
        if not row_requests:
            return
        scores = self._processor.model_runner.kept_scores[: len(row_requests)]
        sampling = [(row, r) for row, r in enumerate(row_requests) if r is not None and not r.params.greedy]
        stream = io.compute_stream
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            probabilities = [_probabilities(scores[row : row + 1], request.warpers) for row, request in sampling]
            # amax is NaN if any score is, +inf if any is, -inf if all are: finite for usable scores only
            checks = [torch.isfinite(scores.amax(dim=-1))]
            checks += [torch.isfinite(p).all(dim=-1) for p in probabilities]
            finite = torch.cat(checks).tolist()  # the step's one wait for the device
            scores_finite, probabilities_finite = finite[: len(row_requests)], finite[len(row_requests) :]
            for row, request in enumerate(row_requests):
                if request is not None and not scores_finite[row]:
                    self._fail_in_step(request, "the model's scores for it are NaN or infinite")
            for (row, request), probs, usable in zip(sampling, probabilities, probabilities_finite):
                if not scores_finite[row]:
                    continue
                if not usable:
                    self._fail_in_step(request, "its sampling settings turn the scores into NaN or infinite "
                                       "probabilities")
                    continue
                token = torch.multinomial(probs, 1, generator=request.generator)
                io.output_ids[0, row] = token[0, 0]

    def _fail_in_step(self, request: _Request, reason: str) -> None:
        """End a request whose scores cannot give a token; transformers drops it (frees its KV) at the next step."""
        adapter = request.handle.adapter
        message = f"{reason} (adapter {adapter!r})" if adapter is not None else f"{reason} (the base model)"
        logger.warning("request %s failed: %s", request.request_id, message)
        self._complete(request, "error", error=message, error_code=GENERATION_FAILED)
        self._cancel(request.request_id)

    def _on_output(self, request_id: str, generated: list[int], finished: bool) -> None:
        """A request's tokens so far (transformers' view), after a step."""
        request = self._requests.get(request_id)
        if request is None:
            return
        if request.handle.done:  # ended here already (stop string, NaN scores): transformers drops it next step
            if finished:  # unless this step finished it in transformers too
                self._release(request)
            return
        new_tokens = generated[request.seen_tokens :]
        request.seen_tokens = len(generated)
        now = time.perf_counter()
        request.token_times.extend([now] * len(new_tokens))
        self._counters["generated_tokens"] += len(new_tokens)
        stopped_by_token = bool(new_tokens) and new_tokens[-1] in request.stop_token_ids
        kept = new_tokens[:-1] if stopped_by_token else new_tokens
        request.token_ids.extend(kept)
        text = request.text.add(kept) if request.text is not None else ""
        if kept or text:
            request.handle._publish(Delta(tuple(kept), text))
        if request.text is not None and request.text.stopped:
            self._complete(request, "stop")
            if finished:
                self._release(request)
            else:  # transformers still runs it: it is dropped (and its KV freed) at the next step
                self._cancel(request_id)
        elif finished:
            self._complete(request, "stop" if stopped_by_token else "length")
            self._release(request)

    def _on_failure(self, request_id: str, error: BaseException | str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            if not request.handle.done:
                self._complete(request, "error", error=str(error), error_code=GENERATION_FAILED)
            self._release(request)

    def _complete(
        self, request: _Request, reason: str, error: str | None = None, error_code: str | None = None
    ) -> None:
        """Hand out the request's last piece and its completion; tell the listeners."""
        tail = request.text.finish() if request.text is not None else ""
        completion = Completion(
            request_id=request.request_id,
            adapter=request.handle.adapter,
            prompt_token_ids=request.handle.prompt_token_ids,
            token_ids=tuple(request.token_ids),
            text=request.text.text if request.text is not None else "",
            finish_reason=reason,
            completion_tokens=request.seen_tokens,
            submitted_at=request.submitted_at,
            first_token_at=request.token_times[0] if request.token_times else None,
            finished_at=time.perf_counter(),
            token_times=tuple(request.token_times),
            error=error,
            error_code=error_code,
        )
        request.handle._publish(Delta((), tail, reason), completion)
        self._finished[reason] += 1
        for listener in self._listeners:
            listener(completion)

    def _release(self, request: _Request) -> None:
        """Forget a request transformers no longer runs, and give its adapter lease back."""
        with self._lock:
            self._requests.pop(request.request_id, None)
        if request.lease is not None:
            request.lease.release()
            request.lease = None

    # ------------------------------------------------------------------ transformers' settings
    def _generation_config(self) -> GenerationConfig:
        """Greedy, no logits processors: per-request settings are applied by the engine."""
        return GenerationConfig(
            do_sample=False,
            eos_token_id=sorted(self.eos_token_ids) or -1,
            pad_token_id=getattr(self.hf_model.generation_config, "pad_token_id", None),
        )

    def _cb_config(self, device: torch.device) -> ContinuousBatchingConfig:
        config = self.config
        max_running, max_batch_tokens, kv_blocks = config.max_running, config.max_batch_tokens, config.kv_blocks
        if device.type == "cpu":
            max_running = max_running or CPU_MAX_RUNNING
            max_batch_tokens = max_batch_tokens or CPU_MAX_BATCH_TOKENS
        else:
            max_batch_tokens = max_batch_tokens or GPU_MAX_BATCH_TOKENS
        cb_config = ContinuousBatchingConfig(
            max_requests_per_batch=max_running,
            max_batch_tokens=max_batch_tokens,
            allow_block_sharing=False,
            use_async_batching=False,
            # transformers would turn graphs on for a CPU model on a machine with a GPU (it asks the machine)
            use_cuda_graph=config.cuda_graphs if device.type == "cuda" else False,
        )
        if self.attention.implementation == attention.NAME and attention.READS_CACHE_IN_PLACE and device.type == "cuda":
            # The kernel reads only each step's real key slots: one padded length for every step's slot list keeps
            # the key count out of the graphs' shapes (transformers pads it up to the whole cache, at most).
            cb_config.kv_padding_interval_size = ONE_KV_PADDING
        if kv_blocks is None and device.type == "cpu":
            kv_blocks = math.ceil(max_running * self.max_model_len / _page_size(cb_config))
        cb_config.num_blocks = kv_blocks
        return cb_config


# ---------------------------------------------------------------------- transformers extension points
class _AdapterSlotIOs(ContinuousBatchingIOs):
    """transformers' batch inputs plus ``adapter_ids`` ``[1, T]``: the GPU adapter slot of every packed token.

    On the engine's own attention path it also builds the keys' cache slots (``read_index``) on the device from
    each request's pages: transformers lists every key of every request in Python (7.6 ms of a 25 ms decode step
    at 128 requests on an H200), this costs a list of pages per request and a few kernels. Where the kernel reads
    the cache in place, graphs are keyed by query count alone: it reads each sequence's keys through
    ``cu_seq_lens_k``, so the key counts are no part of its shapes.
    """

    _slot_of: Callable[[str], int]
    _token_slots: torch.Tensor  # [1, max_batch_tokens] int32 on the model's device; -1 = base model / padding
    _page_groups: list[_PageGroup] | None  # one per attention group; None: transformers builds the key slots

    @classmethod
    def adopt(cls, io: ContinuousBatchingIOs, slot_of: Callable[[str], int], own_attention: bool) -> None:
        if type(io) is not ContinuousBatchingIOs:
            raise TypeError(f"expected transformers' synchronous ContinuousBatchingIOs, got {type(io).__name__}")
        io.__class__ = cls
        io._slot_of = slot_of
        io._token_slots = torch.full((1, io.cache.max_batch_tokens), -1, dtype=torch.int32, device=io.device)
        io._page_groups = _page_groups(io.cache) if own_attention else None

    def prepare_batch_tensors(self, requests_in_batch, logits_processors, use_decode_fast_path: bool,
                              num_q_tokens: int, max_kv_read: int, use_padding: bool) -> None:
        key_lengths = [s.state.position_offset + s.query_length for s in requests_in_batch]  # before they advance
        own_key_slots = self._page_groups is not None and max_kv_read > 0 and not use_decode_fast_path
        super().prepare_batch_tensors(requests_in_batch, logits_processors, use_decode_fast_path, num_q_tokens,
                                      0 if own_key_slots else max_kv_read, use_padding)  # 0: it lists no keys
        if own_key_slots:
            self.max_kv_read = max_kv_read
            self._fill_key_slots([s.state.request_id for s in requests_in_batch], key_lengths,
                                 max_kv_read + num_q_tokens if use_padding else sum(key_lengths))
        slots = [
            slot
            for future_state in requests_in_batch
            for slot in [self._slot_of(future_state.state.request_id)] * future_state.query_length
        ]
        self._token_slots[0, : len(slots)] = torch.tensor(slots, dtype=torch.int32, device=self.device)
        self._token_slots[0, len(slots) : max(self.num_q_tokens, len(slots))] = -1  # padding up to a graph's size
        if self.compute_stream is not None:  # the step runs there: after the inputs written on this stream
            self.compute_stream.wait_stream(torch.cuda.current_stream(self.device))

    def _fill_key_slots(self, request_ids: list[str], key_lengths: list[int], size: int) -> None:
        """``read_index_storage[g, :size]``: every request's keys' slots in order (full attention: all its
        tokens, those of this step included), then the trash slot. transformers' own lists, built on the device."""
        total = sum(key_lengths)
        lengths = torch.tensor(key_lengths, device=self.device)
        starts = lengths.cumsum(0) - lengths
        rows = torch.repeat_interleave(torch.arange(len(key_lengths), device=self.device), lengths, output_size=total)
        positions = torch.arange(total, device=self.device) - starts[rows]
        for index, group in enumerate(self._page_groups):
            pages = [group.owner.block_table[request_id] for request_id in request_ids]
            width = max(map(len, pages))
            page_table = torch.tensor([p + [0] * (width - len(p)) for p in pages], device=self.device)
            page_starts = page_table[rows, positions // group.tokens_per_page] * group.page_stride
            self.read_index_storage[index, :total] = page_starts + positions % group.tokens_per_page
            self.read_index_storage[index, total:size] = group.trash_slot
            self.true_read_sizes[index] = total

    def _get_graph_key(self) -> tuple[int, ...]:
        if self._page_groups is not None and attention.READS_CACHE_IN_PLACE and not self.use_block_table:
            return (self.num_q_tokens,)
        return super()._get_graph_key()

    def get_model_kwargs(self, *args, **kwargs):
        model_kwargs = super().get_model_kwargs(*args, **kwargs)
        model_kwargs["adapter_ids"] = self._token_slots[:, : model_kwargs["input_ids"].shape[1]]
        return model_kwargs


class _ScoreKeepingRunner(ModelRunner):
    """transformers' model runner (greedy) that also leaves each step's scores in ``kept_scores`` ``[R, V]``."""

    kept_scores: torch.Tensor

    @classmethod
    def adopt(cls, runner: ModelRunner, max_rows: int, vocab_size: int) -> None:
        runner.__class__ = cls
        device = runner.inputs_and_outputs.device
        runner.kept_scores = torch.zeros(max_rows, vocab_size, dtype=torch.float32, device=device)

    def _sample(self, scores: torch.Tensor, output_ids: torch.Tensor) -> None:
        self.kept_scores[: scores.shape[1]].copy_(scores[0])  # scores [1, rows, V]; a static copy, graphable
        super()._sample(scores, output_ids)


class _OutputRouter:
    """Takes the place of transformers' output router: keeps each step's outputs (transformers' copies) until
    ``deliver_pending`` hands them to the engine, once the next step is queued on the device."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._pending: list = []

    def deliver(self, output) -> None:
        self._pending.append(output)

    def deliver_batch(self, outputs) -> None:
        self._pending.extend(outputs)

    def deliver_pending(self) -> None:
        pending, self._pending = self._pending, []
        for output in pending:
            if output.error is not None:
                self._engine._on_failure(output.request_id, output.error)
            else:
                self._engine._on_output(output.request_id, output.generated_tokens, output.is_finished())

    def fail_and_deliver(self, state, error: Exception) -> None:
        self.deliver_pending()  # in order: the request's earlier tokens first
        self._engine._on_failure(state.request_id, error)


# ---------------------------------------------------------------------- helpers
class _WarmupFailures(logging.Handler):
    """Collects transformers' "Failed to warm up" warnings (it logs a failed capture and goes on without it)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Failed to warm up"):
            self.messages.append(message.splitlines()[0])


def _memory_report(processor) -> str:
    """The GPU's memory in words, for a failed warm-up."""
    free, total = torch.cuda.mem_get_info(processor.inputs_and_outputs.device)
    return (f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB with a KV cache of "
            f"{processor.cache.num_blocks} blocks and {processor.cache.max_batch_tokens} tokens per step; give "
            f"EngineConfig fewer kv_blocks or max_batch_tokens")


def _warpers(params: SamplingParams) -> tuple:
    """transformers' own warpers for a sampling request, in ``generate()``'s order."""
    warpers = [TemperatureLogitsWarper(params.temperature)] if params.temperature != 1 else []
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    return tuple(warpers)


def _probabilities(row_scores: torch.Tensor, warpers: tuple) -> torch.Tensor:
    """A sampling request's next-token probabilities ``[1, V]`` from its row of the step's scores."""
    for warper in warpers:
        row_scores = warper(None, row_scores)
    return row_scores.softmax(dim=-1)


def _eos_token_ids(hf_model, tokenizer) -> set[int]:
    eos = getattr(hf_model.generation_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
    ids.add(getattr(tokenizer, "eos_token_id", None))
    return {i for i in ids if isinstance(i, int) and i >= 0}


@dataclass(frozen=True)
class _PageGroup:
    """Where one attention group's keys lie: the slot of a request's token at ``position`` is
    ``owner.block_table[request_id][position // tokens_per_page] * page_stride + position % tokens_per_page``."""

    owner: object  # transformers' object that holds the group's pages of each request (``block_table``)
    tokens_per_page: int
    page_stride: int
    trash_slot: int  # what transformers reads for no key


def _page_groups(cache) -> list[_PageGroup]:
    """The cache's attention groups (5.17: group cache managers; 5.18 on: cache allocators, one per layer type)."""
    if hasattr(cache, "cache_allocators"):
        return [_PageGroup(a, a.tokens_per_page, a.block_physical_stride, a.read_trash_index)
                for a in cache.cache_allocators.values()]
    return [_PageGroup(m, m.block_size, m.block_size, cache.read_trash_index) for m in cache.group_cache_managers]


def _page_size(cb_config: ContinuousBatchingConfig) -> int:
    """Tokens per KV page (``page_size`` since transformers 5.18, ``block_size`` before)."""
    return getattr(cb_config, "page_size", None) or cb_config.block_size


def _kv_free_fraction(cache) -> float:
    if hasattr(cache, "compute_free_capacity"):  # transformers >= 5.18
        return float(cache.compute_free_capacity())
    return cache.get_num_free_blocks() / cache.num_blocks
