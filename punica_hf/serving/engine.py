"""Continuous batching in which every request brings its own LoRA adapter and its own generation settings.

The engine queues requests, pins each request's adapter, hands requests to transformers' continuous batching
(through ``transformers_cb.ContinuousBatchingBackend``, the one place that knows transformers' internals), runs
its steps from one engine thread, draws the token of each sampling request with the request's own settings, and
streams each request's tokens and text to its ``RequestHandle``.

Adapters are pinned for each request's lifetime through ``MultiLoraModel.acquire(..., block=False)``: a request
whose adapter is still being loaded, or does not fit next to the adapters running requests hold, waits in the
engine's queue while the batch keeps going. The queue is bounded (``QueueFullError``); cancelling a request frees
its KV blocks at the next step.

Over a tensor-parallel model (``model.tensor_parallel``) every rank makes and starts an engine; rank 0 takes the
requests, the runtime adapter loads and unloads, and decides each step for all ranks (``tp_control``); the other
ranks follow until rank 0 shuts down. A step that fails on any rank stops every rank's engine (``tp_loop``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import random
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from ..norm_layers import NormHook
from ..store import AdapterCapacityError, AdapterNotReady, AdapterReadError
from . import attention, tp_control, transformers_cb
from .handles import RequestHandle
from .request_state import RequestState, eos_token_ids
from .sampling import sample_rows
from .text import Tokenizer, as_tokenizer
from .tp_loop import IDLE_POLL_SECONDS, TensorParallelLoop
# The public types, importable from here as before the split (the server imports some of them from here).
from .types import (  # noqa: F401
    ADAPTER_NOT_FOUND, FINISH_REASONS, GENERATION_FAILED, MAX_REQUEST_ID_LENGTH, MIN_TEMPERATURE, SHUT_DOWN,
    Completion, Delta, EngineClosedError, EngineConfig, EngineStats, QueueFullError, SamplingParams, StepRecord,
    check_seconds,
)

logger = logging.getLogger(__name__)
TESTED_TRANSFORMERS = transformers_cb.TESTED_TRANSFORMERS

# The engine serving each model, from its start() to its shutdown(): an engine sets the model's attention
# implementation and norms for its own steps, and gives back what it found when it stops, under any other engine.
_SERVING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SERVING_LOCK = threading.Lock()


class Engine(TensorParallelLoop):
    """Continuous batching over a ``MultiLoraModel``: ``submit`` requests, each with its adapter (or None for the
    base model) and its ``SamplingParams``, from any thread; one engine thread runs the batch.

    ``tokenizer`` (a transformers tokenizer or any object with ``encode``/``decode``) is needed for text prompts,
    streamed text and stop strings; without it prompts are token ids and outputs token ids only. While the engine
    runs it owns the model: transformers may switch its attention implementation to a paged one, restored by
    ``shutdown()``; another engine over the same model cannot start until then.

        with Engine(model, tokenizer) as engine:
            handle = engine.submit("Hello", adapter="sql", params=SamplingParams(max_new_tokens=32))
            for delta in handle:
                print(delta.text, end="")

    Over a model split by tensor parallelism every rank makes and starts its engine; rank 0 alone submits and
    changes adapters (``load_adapters`` / ``unload_adapter``), the other ranks run its steps until its shutdown
    (``shutdown()`` there waits for it). A step that fails on one rank stops every rank's engine with an error
    naming that rank; a rank then still in one of the model's collectives gets out once the failed rank's process
    leaves the process group (``destroy_process_group()`` or exit), as ``punica-hf serve --tp`` does.
    """

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None) -> None:
        # Split over ranks: rank 0 decides every step for all (made on every rank at once: a collective).
        self._control = tp_control.ControlChannel() if model.tensor_parallel else None
        self.model = model
        self.hf_model = model.model  # what transformers' continuous batching runs; its forward takes slots
        self.tokenizer: Tokenizer | None = None if tokenizer is None else as_tokenizer(tokenizer)
        self.config = config or EngineConfig()
        text_config = self.hf_model.config.get_text_config()
        self.vocab_size = text_config.vocab_size
        self.eos_token_ids = frozenset(eos_token_ids(self.hf_model, tokenizer))
        self.max_model_len = min(
            self.config.max_model_len or math.inf, getattr(text_config, "max_position_embeddings", None) or math.inf
        )
        if self.max_model_len == math.inf:
            raise ValueError("the model config has no max_position_embeddings: give EngineConfig(max_model_len=...)")
        self._requests: dict[str, RequestState] = {}  # every request not yet finished, by id
        self._queue: deque[RequestState] = deque()  # submitted, not yet handed to transformers
        self._lock = threading.Lock()  # guards _queue, _requests (insertions) and _cancels
        self._cancels: set[str] = set()
        # Tensor parallel: adapter changes asked on rank 0, each with its caller's future, for the next pass (None
        # once the loop has ended).
        self._adapter_changes: list[tuple[tp_control.AdapterChange, Future]] | None = []
        self._changes_sent: list[tuple[tp_control.AdapterChange, Future]] = []  # in the last record, not answered
        self._wake = threading.Event()
        self._accepting = False
        self._stop = False
        self._closed = False  # shut down: the batch processor closed
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self._counters = Counter()
        self._finished = Counter()
        self._last_batch = (0, 0, 0)  # the last step's requests, packed tokens and key tokens
        self._listeners: list[Callable[[Completion], None]] = []
        self._step_listeners: list[Callable[[StepRecord], None]] = []
        self.attention: attention.AttentionChoice | None = None  # the attention path, chosen by start()
        self._backend: transformers_cb.ContinuousBatchingBackend | None = None  # made by start()
        self._norm_hooks: list[NormHook] = []  # the model's fused norms while the engine runs (start())

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Engine:
        """Build transformers' batch processor (and capture CUDA graphs), then start the engine thread."""
        if self._thread is not None:
            raise RuntimeError("the engine was started already")
        if self._stop:
            raise RuntimeError("the engine was shut down: make a new one")
        self.attention = attention.choose(self.hf_model)
        logger.info("attention: %s (%s)", self.attention.path, self.attention.reason)
        self.model.decide_backends()  # before any step is compiled or captured
        with _SERVING_LOCK:
            other = _SERVING.get(self.model)
            if other is not None:
                raise RuntimeError("another engine serves this model: shut it down before starting this one (its "
                                   "shutdown would give the model back its own attention under this one)")
            _SERVING[self.model] = self
        backend = None
        try:
            self._norm_hooks = self.model.fuse_norms()
            with torch.inference_mode():
                backend = transformers_cb.ContinuousBatchingBackend(
                    self.hf_model, self._cb_config(self.hf_model.device), eos_token_ids=sorted(self.eos_token_ids),
                    vocab_size=self.vocab_size, slot_of=self._slot_of, prefix_key_of=self._prefix_key_of,
                    on_tokens=self._on_output,
                    on_failure=self._on_failure, attention=self.attention.implementation,
                    attention_forward=attention.paged_attention_forward,
                )
                if self.config.warmup:
                    backend.warm_up()
        except BaseException:
            self._give_model_back(backend)
            raise
        self._graphs_layout = self.model.layout_version
        self.max_model_len = min(self.max_model_len, backend.kv_tokens)
        with self._lock:  # against a shutdown() meanwhile, which stops only a thread (and closes a backend) it finds
            stopped = self._stop
            if not stopped:
                self._backend = backend
                self._accepting = True
                self._thread = threading.Thread(target=self._run, name="punica-hf-engine", daemon=True)
                self._thread.start()
        if stopped:
            self._give_model_back(backend)
            raise RuntimeError("the engine was shut down while it started")
        if self._control is not None and self._control.leader:
            threading.Thread(target=self._watch_other_ranks, name="punica-hf-tp-watch", daemon=True).start()
        return self

    def shutdown(self, drain: bool = True, timeout: float | None = None, *, drain_seconds: float | None = None) -> None:
        """Stop taking requests; finish the ones in flight (``drain``) or cancel them; stop the engine thread.

        ``drain_seconds`` bounds the drain: the requests still unfinished then fail (``finish_reason`` "error",
        ``error_code`` ``SHUT_DOWN``; their KV freed), so that a caller can answer them, and the engine stops.
        None drains for as long as the requests take. ``timeout``: how long to wait for the engine thread after
        that (``TimeoutError`` beyond). Several threads may shut the engine down at once: each returns once the
        engine thread has stopped, and the earliest drain deadline holds. On a tensor-parallel follower (rank > 0)
        this waits for rank 0's shutdown, which decides ``drain``."""
        if drain_seconds is not None:
            check_seconds("drain_seconds", drain_seconds)
        with self._lock:
            self._accepting = False
            if not drain:
                self._cancels.update(self._requests)
            self._stop = True
        self._wake.set()
        if self._thread is not None:
            if drain and drain_seconds is not None:
                self._thread.join(drain_seconds)
                if self._thread.is_alive():
                    self._cut_off("the server shut down before this request finished (the time it gives the "
                                  "requests in flight ran out); retry")
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the engine did not stop within {timeout} s")
        with self._lock:  # once, where several threads shut down together
            closing, self._closed = not self._closed, True
        if closing and self._backend is not None:
            self._give_model_back(self._backend)

    def _give_model_back(self, backend: transformers_cb.ContinuousBatchingBackend | None) -> None:
        """The model as before start(): its attention implementation, its norms' own forwards."""
        with self._lock:  # the hooks go back once, whichever thread gets here
            hooks, self._norm_hooks = self._norm_hooks, []
        try:
            if backend is not None:
                backend.close()
        finally:
            for hook in hooks:
                hook.remove()
            with _SERVING_LOCK:
                if _SERVING.get(self.model) is self:
                    del _SERVING[self.model]

    def _cut_off(self, reason: str) -> None:
        """End every request in flight as failed with ``reason``: the engine thread drops them (and frees their KV)
        as it drops cancelled ones, and ends them with this reason instead of "cancelled"."""
        with self._lock:
            for request in self._requests.values():
                request.cut_off = reason
            self._cancels.update(self._requests)
            unfinished = sum(not request.handle.done for request in self._requests.values())
        if unfinished:
            logger.warning("shutting down: %d requests in flight fail: %s", unfinished, reason)
        self._wake.set()

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
        """Call ``listener(completion)`` in the engine thread whenever a request finishes (metrics, logs). An
        exception from it is logged; the request and the engine go on as if it had returned."""
        self._listeners.append(listener)

    def add_step_listener(self, listener: Callable[[StepRecord], None]) -> None:
        """Call ``listener(record)`` in the engine thread after every step (metrics, benchmarks)."""
        self._step_listeners.append(listener)

    def _tell_step_listeners(self, started: float, prepared: float) -> None:
        if self._step_listeners:
            requests, tokens, key_tokens = self._last_batch
            record = StepRecord(requests, tokens, time.perf_counter() - started, prepared - started,
                                self._backend.step_device_seconds(), key_tokens)
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
        (empty, longer than ``max_model_len`` with its new tokens, a token id outside the vocabulary) or a
        ``request_id`` that is in use or not a non-empty string of at most ``MAX_REQUEST_ID_LENGTH`` characters,
        ``QueueFullError`` when the queue is full and ``EngineClosedError`` when the engine is not running.
        """
        return self.submit_all([(prompt, adapter, params)], request_ids=[request_id])[0]

    def submit_all(
        self,
        requests: Sequence[tuple[str | Sequence[int], str | None, SamplingParams | None]],
        request_ids: Sequence[str | None] | None = None,
    ) -> list[RequestHandle]:
        """Queue every ``(prompt, adapter, params)`` of ``requests``, or none: each is checked as ``submit`` checks
        it, and the queue must have room for all (one ``QueueFullError``, counted once). A server's request with
        several prompts is one of these: a bad last prompt leaves no earlier one queued, counted or run."""
        request_ids = [None] * len(requests) if request_ids is None else list(request_ids)
        if len(request_ids) != len(requests):
            raise ValueError(f"{len(requests)} requests but {len(request_ids)} request ids")
        if self._control is not None and not self._control.leader:
            raise RuntimeError(
                f"submit requests on rank 0 only: rank {self._control.rank} runs what rank 0 schedules"
            )
        if not self.running:
            raise EngineClosedError(
                "the engine is not running" + (f": it stopped after an error: {self._error}" if self._error else "")
            )
        checked = [self._checked(prompt, adapter, params or SamplingParams(), request_id)
                   for (prompt, adapter, params), request_id in zip(requests, request_ids)]
        handles = []
        with self._lock:  # the engine thread decides to end, or fails its requests, under this lock too
            if not self.running:  # it stopped while these requests were checked (tokenizing may take a while)
                raise EngineClosedError("the engine stopped while the request was being checked"
                                        + (f": {self._error}" if self._error else ""))
            if len(self._queue) + self._waiting_count() + len(checked) > self.config.max_queue:
                self._counters["rejected"] += 1
                raise QueueFullError(f"the engine's queue is full ({self.config.max_queue} requests waiting)")
            named = [request_id for *_, request_id in checked if request_id is not None]
            in_use = [request_id for request_id in named if request_id in self._requests or named.count(request_id) > 1]
            if in_use:
                raise ValueError(f"request id {in_use[0]!r} is in use")
            for prompt_ids, adapter, registration, params, request_id in checked:
                if request_id is None:  # the next automatic id that no running request (a caller's "req-3") holds
                    request_id = next(rid for rid in (f"req-{n}" for n in self._ids)
                                      if rid not in self._requests and rid not in named)
                request = RequestState.create(
                    RequestHandle(self._cancel, request_id, adapter, tuple(prompt_ids)), params, self.eos_token_ids,
                    None if self.tokenizer is None else self.tokenizer.decode,
                )
                request.registration = registration
                self._requests[request_id] = request
                self._queue.append(request)
                handles.append(request.handle)
        self._wake.set()
        return handles

    def _checked(self, prompt: str | Sequence[int], adapter: str | None, params: SamplingParams,
                 request_id: str | None) -> tuple[list[int], str | None, int | None, SamplingParams, str | None]:
        """One request checked as ``submit`` documents, before anything is queued: its prompt's token ids, its
        adapter and that adapter's registration, its settings (a sampling request's seed drawn under tensor
        parallelism, the same on every rank) and its id."""
        registration = None
        if adapter is not None:
            try:
                if adapter not in self.model.adapters:  # (a name; an index is no adapter here)
                    raise KeyError(adapter)
                registration = self.model.adapter_registration(adapter)
            except KeyError:
                raise KeyError(f"unknown adapter {adapter!r}; registered: {sorted(self.model.adapters)}") from None
        prompt_ids = self._prompt_ids(prompt)
        if len(prompt_ids) + params.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) exceeds the "
                f"{self.max_model_len}-token limit of this engine"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: give the engine one, or use stop_token_ids")
        valid_id = isinstance(request_id, str) and 0 < len(request_id) <= MAX_REQUEST_ID_LENGTH
        if request_id is not None and not valid_id:
            raise ValueError(f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_LENGTH} characters, "
                             f"got {type(request_id).__name__} {str(request_id)[:40]!r}")
        if self._control is not None and not params.greedy and params.seed is None:
            params = dataclasses.replace(params, seed=random.randrange(2**63))  # sent to every rank with the request
        return prompt_ids, adapter, registration, params, request_id

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        adapters: Sequence[str | None],
        params: SamplingParams | None = None,
    ) -> list[Completion]:
        """Submit every prompt with its adapter and wait for all: the completions in the prompts' order."""
        if len(prompts) != len(adapters):
            raise ValueError(f"{len(prompts)} prompts but {len(adapters)} adapters")
        handles = self.submit_all([(prompt, adapter, params) for prompt, adapter in zip(prompts, adapters)])
        return [handle.result() for handle in handles]

    def load_adapters(self, sources: Mapping[str, str | Path]) -> dict[str, int]:
        """Register adapters while the engine runs, all or none: ``MultiLoraModel.load_adapters`` of local paths.

        Over a tensor-parallel model, on rank 0 only and while the engine runs: every rank loads them from the same
        paths (the ranks share one machine's files) at the next pass, and none keeps them unless every rank could;
        the error is rank 0's own, or a ValueError naming each rank that failed and why."""
        if self._control is None:
            return self.model.load_adapters(sources)
        if not isinstance(sources, Mapping) or not all(isinstance(path, (str, Path)) for path in sources.values()):
            raise ValueError("under tensor parallelism load_adapters takes {name: local path}, read on every rank")
        return self._ask_adapter_change(tp_control.AdapterChange(load=tuple(
            (name, str(path)) for name, path in sources.items()
        )))

    def unload_adapter(self, name: str) -> None:
        """Unregister an adapter (``MultiLoraModel.unload_adapter``): requests running with it finish with it, queued
        ones fail. Over a tensor-parallel model, on rank 0 only: every rank unloads it at the next pass."""
        if self._control is None:
            return self.model.unload_adapter(name)
        self._ask_adapter_change(tp_control.AdapterChange(unload=name))

    def stats(self) -> EngineStats:
        backend = self._backend
        return EngineStats(
            queued=len(self._queue),
            waiting=self._waiting_count(),
            running=0 if backend is None else backend.running,
            last_batch_requests=self._last_batch[0],
            last_batch_tokens=self._last_batch[1],
            steps=self._counters["steps"],
            prompt_tokens=self._counters["prompt_tokens"],
            generated_tokens=self._counters["generated_tokens"],
            finished={reason: self._finished[reason] for reason in FINISH_REASONS},
            dropped_and_freed=self._counters["dropped_and_freed"],
            rejected=self._counters["rejected"],
            kv_free_fraction=1.0 if backend is None else backend.kv_free_fraction,
            cuda_graphs=0 if backend is None else backend.cuda_graphs,
            prefix_hit_tokens=0 if backend is None else backend.prefix_hit_tokens,
        )

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: give the engine one, or submit token ids")
            prompt_ids = list(self.tokenizer.encode(prompt))
            problem = "the tokenizer turned the prompt into token ids outside the model's vocabulary"
        else:
            prompt_ids = list(prompt)
            problem = "prompt token ids must be integers in"
        # A token the embedding has no row for would fail the whole step, the other requests' rows with it.
        bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{problem} [0, {self.vocab_size}), got {bad[:5]}")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        return prompt_ids

    def _waiting_count(self) -> int:
        """Requests in transformers' scheduler that have not started yet."""
        return 0 if self._backend is None else self._backend.waiting

    def _cancel(self, handle: RequestHandle) -> None:
        """Stop the request of ``handle`` at the next pass. Nothing once that request is released: its id may name a
        later request by then (a client's cancel that raced its request's end)."""
        with self._lock:
            request = self._requests.get(handle.request_id)
            if request is None or request.handle is not handle:
                return
            self._cancels.add(handle.request_id)
        self._wake.set()

    def _slot_of(self, request_id: str) -> tuple[int, int]:
        """GPU slot of a scheduled request's adapter (-1: base model, or transformers' own warm-up requests), and the
        first position it applies to (aLoRA: the prompt's last invocation; see ``RequestState.adapter_start``)."""
        request = self._requests.get(request_id)
        if request is None or request.adapter_start is None:
            return -1, 0
        return request.slot, request.adapter_start

    def _prefix_key_of(self, request_id: str) -> transformers_cb.PrefixKey | None:
        """What a request's KV pages are shared under besides its tokens (``RequestState.prefix_key``). A request
        the engine does not know (transformers' warm-up) gets a key of its own: no sharing."""
        request = self._requests.get(request_id)
        return (f"unknown {request_id} {next(self._ids)}", 0) if request is None else request.prefix_key

    @staticmethod
    def _prefix_key(request: RequestState) -> transformers_cb.PrefixKey | None:
        """An admitted request's prefix key: its adapter's registration and the first position the adapter
        computes (None: the base model). Under tensor parallelism rank 0's key goes to every rank with the
        admission, so all ranks match the same pages."""
        if request.lease is None or request.adapter_start is None:  # aLoRA never invoked: the base model's pages
            return None
        # an aLoRA page depends on where the adapter starts, which tokens after it (a later invocation) can move
        start = request.adapter_start
        return f"adapter {request.lease.registrations[0]} from {start}", start

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        if self.hf_model.device.type == "cuda":
            torch.cuda.set_device(self.hf_model.device)
        try:
            with torch.inference_mode():
                if self._control is None:
                    self._loop()
                else:
                    self._tensor_parallel_loop()
        except BaseException as error:  # the batch state is unknown now: fail every request, refuse new ones
            logger.exception("the engine thread stopped")
            if self._control is not None:
                error = self._tensor_parallel_failure(error)
            with self._lock:  # submit() refuses from now on: every request it accepted is failed below
                self._error = error
            try:
                self._backend.deliver_outputs()
            except Exception:  # whatever the outputs' failure, every request still ends below
                logger.exception("the last outputs could not be handed out")
            self._fail_unfinished(f"the engine stopped: {error}", release=True)
            if self._control is not None:
                self._after_tensor_parallel_failure(error)
        finally:
            if self._control is not None:
                self._fail_adapter_changes("the engine stopped before every rank applied the adapter change",
                                           close=True)

    def _fail_unfinished(self, message: str, release: bool) -> None:
        """End every request not finished yet with ``message``; ``release``: forget them all too (the engine thread
        only: the batch may still hold them otherwise)."""
        for request in list(self._requests.values()):
            if not request.handle.done:
                self._complete(request, "error", error=message, error_code=GENERATION_FAILED)
            if release:
                self._release(request)

    def _loop(self) -> None:
        """The engine thread's loop in one process: admit, cancel, step; idle, wait for a request."""
        while True:
            started = time.perf_counter()
            self._admit()
            cancelled = self._send_cancellations()
            if self._run_pass(started, cancelled):
                continue
            if self._finished_stopping():
                return
            self._wake.wait(IDLE_POLL_SECONDS if self._queue else None)
            self._wake.clear()

    def _finished_stopping(self) -> bool:
        """Whether the engine is shutting down with no request left. Under the lock that ``submit()`` accepts
        under, so no request it accepts is left behind (shutdown stops accepting before it sets ``_stop``)."""
        with self._lock:
            return self._stop and not self._requests

    def _run_pass(self, started: float, cancelled: list[RequestState]) -> bool:
        """Drop the cancelled requests, then run a step if one is scheduled; returns whether one ran."""
        has_batch = self._backend.prepare()  # drops cancelled requests, frees their KV
        if cancelled:
            # Their last step's outputs first: once a request is released below its id is free for a new request,
            # which must not be handed them. (The others' wait, to be handed out while the next step runs.)
            self._backend.deliver_outputs({request.request_id for request in cancelled})
        for request in cancelled:
            self._counters["dropped_and_freed"] += 1
            if not request.handle.done:
                self._end_cancelled(request)
            self._release(request)
        if has_batch:
            prepared = time.perf_counter()
            self._step()
            self._tell_step_listeners(started, prepared)
            return True
        self._backend.deliver_outputs()  # no step to overlap with: the last step's tokens now
        return False

    def _hand_to_backend(self, request: RequestState) -> None:
        self._backend.add(request.request_id, list(request.handle.prompt_token_ids),
                          request.params.max_new_tokens, sorted(request.stop_token_ids))
        self._counters["prompt_tokens"] += len(request.handle.prompt_token_ids)

    def _admit(self) -> list[RequestState]:
        """Hand queued requests, in order, to transformers' scheduler while it has room, each once its adapter is
        pinned on the GPU. A request whose adapter is still loading waits without holding up the others; once one
        finds every GPU slot pinned, the adapter requests behind it wait too (base requests go on), so the pinned
        adapters drain and it gets its slot. Returns the requests handed over, in order."""
        room = self._backend.max_requests - self._waiting_count()
        slots_full = False
        admitted = []
        with self._lock:
            candidates = list(self._queue)
        for request in candidates:
            if room <= 0:
                break
            adapter = request.handle.adapter
            if adapter is not None:
                if slots_full:
                    continue
                try:
                    # the load it was submitted for: another load under its name (a reload) counts as unloaded, and
                    # places nothing (under tensor parallelism rank 0 alone would: the request reaches no other rank)
                    request.lease = self.model.acquire([adapter], block=False, registrations=[request.registration])
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
                    elif isinstance(error, AdapterReadError):  # it names the adapter and its source
                        message, code = str(error), GENERATION_FAILED
                    else:
                        message, code = f"adapter {adapter!r}: {error}", GENERATION_FAILED
                    self._complete(request, "error", error=message, error_code=code)
                    self._release(request)
                    continue
                request.slot = request.lease.slots[0]
            request.prefix_key = self._prefix_key(request)
            self._remove_from_queue(request)
            self._hand_to_backend(request)
            admitted.append(request)
            room -= 1
        return admitted

    def _remove_from_queue(self, request: RequestState) -> None:
        with self._lock:
            self._queue.remove(request)

    def _send_cancellations(self) -> list[RequestState]:
        """Pass the cancelled requests to transformers; return those it drops at the next ``prepare``."""
        with self._lock:
            cancels, self._cancels = self._cancels, set()
            queued = [r for r in self._queue if r.request_id in cancels]
            for request in queued:
                self._queue.remove(request)
        for request in queued:
            self._end_cancelled(request)
            self._release(request)
        handed_over = []
        for request_id in cancels:
            request = self._requests.get(request_id)
            if request is not None and request not in queued:
                self._backend.cancel(request_id)
                handed_over.append(request)
        return handed_over

    def _step(self) -> None:
        """One forward over the scheduled requests, then each request's new token."""
        backend = self._backend
        layout = self.model.layout_version
        if layout != self._graphs_layout:  # a LoRA hook added since the graphs were captured: capture again
            backend.drop_graphs()
            self._graphs_layout = layout
        self._last_batch = backend.batch_shape
        try:
            backend.forward()
            # The last step's tokens go to their requests (text, stop strings, streams) while this one runs on the
            # device: its graph is queued, and the first wait for it is in the check below.
            backend.deliver_outputs()
            self._check_scores_and_sample()
            backend.fetch_outputs()
        except Exception as error:  # this batch's requests fail; the others and the engine go on
            if self._control is not None:  # but the other ranks ran (or wait in) this step's collectives: all stop
                raise tp_control.StepFailed(
                    f"rank {self._control.rank}: a step failed: {type(error).__name__}: {error}"
                ) from error
            logger.exception("a batch failed")
            backend.deliver_outputs()
            backend.fail_step(error)
            return
        self._counters["steps"] += 1
        backend.end_step()

    def _check_scores_and_sample(self) -> None:
        """Fail each request whose scores (or, sampling, whose probabilities) are NaN or infinite, alone: the
        others in the batch keep their tokens. Then replace the greedy token of each sampling request by one drawn
        with its own settings and random stream (all at once: ``sampling.sample_rows``)."""
        backend = self._backend
        row_requests = [self._requests.get(request_id) for request_id in backend.rows()]
        if not row_requests:
            return
        with backend.on_compute_stream():
            samplers = [None if request is None else request.sampler for request in row_requests]
            sampled = sample_rows(backend.scores(len(row_requests)), samplers)
            if self._control is not None:
                sampled = self._agree_on_samples(sampled)
            for row, reason in sampled.failures:
                if row_requests[row] is not None:  # else a request the engine has forgotten already
                    self._fail_in_step(row_requests[row], reason)
            if sampled.rows:
                backend.set_tokens(sampled.rows, sampled.tokens)

    def _fail_in_step(self, request: RequestState, reason: str) -> None:
        """End a request whose scores cannot give a token; transformers drops it (frees its KV) at the next step."""
        adapter = request.handle.adapter
        message = f"{reason} (adapter {adapter!r})" if adapter is not None else f"{reason} (the base model)"
        logger.warning("request %s failed: %s", request.request_id, message)
        self._complete(request, "error", error=message, error_code=GENERATION_FAILED)
        self._cancel(request.handle)

    def _on_output(self, request_id: str, generated: list[int], finished: bool) -> None:
        """A request's tokens so far (transformers' view), after a step. A request whose tokens cannot be handed out
        (its tokenizer's ``decode`` raised) fails alone; the others of the step get theirs."""
        request = self._requests.get(request_id)
        if request is None:
            return
        try:
            self._take_output(request, generated, finished)
        except Exception as error:
            logger.exception("request %s failed: its tokens could not be handed out", request_id)
            if request.text is not None:
                request.text.abandoned = True  # its completion must not decode again
            if not request.handle.done:
                self._complete(request, "error", error=f"its tokens could not be handed out: {error}",
                               error_code=GENERATION_FAILED)
            self._end_in_backend(request, finished)

    def _take_output(self, request: RequestState, generated: list[int], finished: bool) -> None:
        if request.handle.done:  # ended here already (stop string, NaN scores): transformers drops it next step
            if finished:  # unless this step finished it in transformers too
                self._release(request)
            return
        seen = request.seen_tokens
        kept, text, stopped_by_token = request.take_tokens(generated)
        self._counters["generated_tokens"] += request.seen_tokens - seen
        if kept or text:
            request.handle._publish(Delta(tuple(kept), text))
        if request.stopped_by_text:
            self._complete(request, "stop")
            self._end_in_backend(request, finished)
        elif finished:
            self._complete(request, "stop" if stopped_by_token else "length")
            self._release(request)

    def _end_in_backend(self, request: RequestState, finished: bool) -> None:
        """A request ended here: released if transformers finished it too, else cancelled (transformers drops it,
        and frees its KV, at the next step)."""
        if finished:
            self._release(request)
        else:
            self._cancel(request.handle)

    def _on_failure(self, request_id: str, error: BaseException | str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            if not request.handle.done:
                self._complete(request, "error", error=str(error), error_code=GENERATION_FAILED)
            self._release(request)

    def _complete(
        self, request: RequestState, reason: str, error: str | None = None, error_code: str | None = None
    ) -> None:
        """Hand out the request's last piece and its completion; tell the listeners."""
        tail, completion = request.finish(reason, error, error_code)
        request.handle._publish(Delta((), tail, reason), completion)
        self._finished[reason] += 1
        for listener in self._listeners:
            try:
                listener(completion)
            except Exception:  # an observer (metrics, logs): its failure must not leave the request half ended
                logger.exception("a completion listener failed on request %s", completion.request_id)

    def _end_cancelled(self, request: RequestState) -> None:
        """End a request dropped on a cancel: "cancelled", or failed if a shutdown cut it off (``_cut_off``)."""
        if request.cut_off is None:
            self._complete(request, "cancelled")
        else:
            self._complete(request, "error", error=request.cut_off, error_code=SHUT_DOWN)

    def _release(self, request: RequestState) -> None:
        """Forget a request transformers no longer runs, and give its adapter lease back. Once released, its id may
        name a new request, which a second release of this one leaves alone."""
        with self._lock:
            if self._requests.get(request.request_id) is request:
                del self._requests[request.request_id]
                self._cancels.discard(request.request_id)  # a cancel that came too late must not stop a namesake
        if request.lease is not None:
            request.lease.release()
            request.lease = None

    def _cb_config(self, device: torch.device):
        """transformers' batching settings for this engine on ``device``."""
        max_running, max_batch_tokens = self.config.batch_limits(device.type)
        cuda_graphs = self.config.cuda_graphs
        if cuda_graphs is None and not self.model.graphable:  # adapters on MoE experts: their LoRA runs eagerly
            logger.info("CUDA graphs are off: an adapter on MoE experts is loaded, whose update runs eagerly")
            cuda_graphs = False
        if self._control is not None and self._control.model_backend == "gloo" and device.type == "cuda":
            # gloo moves CUDA tensors through host copies and waits for them: no CUDA graph can capture that
            if cuda_graphs:
                logger.warning("CUDA graphs are off: the split model's collectives run on gloo, which they cannot "
                               "capture (NCCL can)")
            cuda_graphs = False
        return transformers_cb.batching_config(
            device, max_running=max_running, max_batch_tokens=max_batch_tokens, kv_blocks=self.config.kv_blocks,
            cuda_graphs=cuda_graphs, max_model_len=self.max_model_len,
            pad_keys_to_cache=self.attention.implementation == attention.NAME and device.type == "cuda",
            prefix_sharing=self.config.prefix_caching, compile_steps=self.config.compile_steps,
        )
