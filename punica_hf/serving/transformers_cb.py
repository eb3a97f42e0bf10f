"""The one module that touches transformers' non-public continuous-batching API (tested with
``TESTED_TRANSFORMERS``); the engine drives it through ``ContinuousBatchingBackend``.

transformers' continuous batching does the work (paged KV cache, scheduler with chunked prefill and offloading,
packed ``[1, T]`` batches, attention paths, CUDA graphs) but has no per-request adapter, no per-request
sampling and, from 5.24, no attention that reads the paged cache in place, so this module extends it at four points:

- ``_AdapterSlotIOs``: the batch inputs gain ``adapter_ids`` ``[1, T]``, the GPU slot of each packed token's
  request (-1 = base model, padding, and an aLoRA request's tokens before its invocation), in a static buffer
  that CUDA graphs captured once read at every replay; the wrapped model's ``forward`` takes it to the LoRA layers.
  A step in which no token has an adapter goes without it (the base model alone, no LoRA kernels), from graphs of
  its own.
- ``_ScoreKeepingRunner``: greedy decoding stays inside transformers' (graphable) step, which also copies its
  scores into a static buffer; the engine draws each sampling request's token from it with the request's own
  settings and generator, so a seeded request gives the same text whatever else is in the batch.
- ``_OutputRouter``: each step's outputs wait until the engine hands them out, while the next step runs.
- ``_EngineCache``: prefix caching keyed by adapter (transformers' block hashes know only the tokens, but keys and
  values depend on the adapter: each request's tokens are hashed with its adapter's registration, so only requests
  of the same adapter load, or of the base model, share pages); and its ``update`` hands the engine's attention the
  cache itself rather than a copy of every key the step reads (``layer_cache`` finds a layer's keys and values).

transformers builds those objects inside its batch processor with no hook to pass other classes, so the backend
switches the class of those instances (keeping every reference transformers holds). Each use of a private name
carries a note, "upstream hook:", naming what would remove it.
"""

from __future__ import annotations

import gc
import hashlib
import math
import warnings
from array import array
from collections.abc import Callable, Collection
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple

import torch
import transformers
from packaging.version import Version

# The pin in pyproject.toml (tests/test_house.py keeps the two equal): widen both once a release passes CI's suite.
TESTED_TRANSFORMERS = ">=5.17,<5.26"
_LOWEST, _FIRST_UNTESTED = (Version(bound.lstrip("<>=")) for bound in TESTED_TRANSFORMERS.split(","))


def check_transformers_version(version: str | None = None) -> None:
    """Refuse a transformers older than the tested range (its continuous-batching API lacks what this module
    extends); warn about a newer one (private API may have moved). ``version``: the installed one by default."""
    version = transformers.__version__ if version is None else version
    release = Version(Version(version).base_version)  # 5.26.0.dev0 and 5.26.0rc1 count as 5.26.0
    pin = f"pip install 'transformers{TESTED_TRANSFORMERS}'"
    if release < _LOWEST:
        raise ImportError(f"punica_hf's serving engine needs transformers {TESTED_TRANSFORMERS}; {version} is "
                          f"installed, whose continuous batching lacks what the engine extends: {pin}")
    if release >= _FIRST_UNTESTED:
        warnings.warn(f"punica_hf's serving engine is tested with transformers {TESTED_TRANSFORMERS}, and {version} "
                      f"is installed: the engine reaches into transformers' private continuous-batching code, which "
                      f"may have changed. If serving fails, {pin}", RuntimeWarning, stacklevel=2)


check_transformers_version()

# After the version check, so that an old transformers gets its message rather than a failed import:
from transformers import AttentionInterface, CompileConfig, ContinuousBatchingConfig, GenerationConfig  # noqa: E402
from transformers.generation.continuous_batching.cache import PagedAttentionCache  # noqa: E402
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs  # noqa: E402
from transformers.generation.continuous_batching.model_runner import ModelRunner  # noqa: E402

# 5.17 looks paged implementations up as "paged|<name>" (it registers "paged|sdpa"); later versions drop the prefix.
# upstream hook: a public "is this name registered" query on AttentionInterface
PAGED_PREFIX = "paged|" if "paged|sdpa" in AttentionInterface._global_mapping else ""
# transformers (5.17-5.25) turns CUDA graphs on and the 4D mask off for names that contain "flash"; its flash-only
# decode fast path (block tables) stays off, since the name names no flash-attn version.
# upstream hook: attention functions registered with their own "needs a mask / graphable" flags
ATTENTION_NAME = PAGED_PREFIX + "punica_flash"
SDPA_NAME = PAGED_PREFIX + "sdpa"
ONE_KV_PADDING = 1 << 40  # a padding interval longer than any cache: every step's slot list padded to the cache
# What a request's KV pages are shared under besides its tokens: its adapter's key, and the first position the
# adapter computes (0; an aLoRA's invocation): the pages wholly before it hold the base model's keys and values.
PrefixKey = tuple[str, int]


def set_attention(hf_model, implementation: str, forward: Callable) -> list[tuple[object, str | None]]:
    """Register ``forward`` as the punica attention and point every config of ``hf_model`` at ``implementation``;
    returns what ``restore_attention`` puts back.

    The configs are set directly: ``set_attn_implementation`` would try to import flash-attn for any name that
    contains ``flash``. Models read the name at every forward, so this takes effect at the next step.
    upstream hook: ``set_attn_implementation`` accepting registered custom paged implementations
    """
    AttentionInterface.register("punica_flash", forward)
    AttentionInterface.register("paged|punica_flash", forward)
    saved = []
    for config in _configs(hf_model):
        saved.append((config, config._attn_implementation))
        config._attn_implementation = implementation
    return saved


def restore_attention(saved: list[tuple[object, str | None]]) -> None:
    for config, implementation in saved:
        config._attn_implementation = implementation


class LayerCache(NamedTuple):
    """Where one layer's keys and values lie in the paged cache: rows ``key_row`` to ``key_row + rows`` of ``keys``
    ``[N, Hkv, D]`` are the layer's keys, indexed by the slots of its attention group's ``read_index`` /
    ``write_index``; the same for the values. From transformers 5.18 every layer's keys and values are shifted
    along one tensor, so ``keys`` and ``values`` are that one tensor for every layer: a compiled step then takes the
    whole cache as one input, which it can write in place, rather than two views of it per layer."""

    group: int
    keys: torch.Tensor
    key_row: int
    values: torch.Tensor
    value_row: int
    rows: int


def layer_cache(cache, layer_idx: int) -> LayerCache:
    """Where layer ``layer_idx``'s keys and values lie in the engine's paged cache (``_EngineCache``)."""
    located = cache.layer_caches.get(layer_idx)
    if located is None:
        raise ValueError(f"layer {layer_idx}'s paged cache holds no plain keys and values the engine's attention "
                         f"can read (transformers {transformers.__version__}); serve this model with flash-attn or "
                         f"transformers' paged sdpa")
    return located


def _layer_caches(cache: PagedAttentionCache) -> dict[int, LayerCache]:
    """Every layer's ``LayerCache``, found from the views transformers' own ``update`` writes and reads.
    upstream hook: the attention function handed its layer's key and value caches"""
    if hasattr(cache, "layer_to_allocator"):  # 5.18 on: one allocator per attention type, its views per layer
        views = {layer: (allocator.index, *allocator._kv_token_views[layer])
                 for layer, allocator in cache.layer_to_allocator.items()
                 if layer in getattr(allocator, "_kv_token_views", ())}  # 5.25's latent caches hold none
    else:  # 5.17: two tensors per layer
        views = {layer: (group, cache.key_cache[index], cache.value_cache[index])
                 for layer, (group, index) in cache.layer_index_to_group_indices.items()}
    # The tensor each view is rows of: of the views on one storage, the one that starts first.
    whole: dict[int, torch.Tensor] = {}
    for _, keys, values in views.values():
        for view in (keys, values):
            first = whole.setdefault(view.untyped_storage().data_ptr(), view)
            if view.storage_offset() < first.storage_offset():
                whole[view.untyped_storage().data_ptr()] = view

    def located(view: torch.Tensor, rows: int) -> tuple[torch.Tensor, int]:
        base = whole[view.untyped_storage().data_ptr()]
        row, rest = divmod(view.storage_offset() - base.storage_offset(), base.stride(0))
        if rest or view.stride() != base.stride() or row + rows > base.shape[0]:
            raise RuntimeError(f"transformers {transformers.__version__}'s paged cache is laid out in a way this "
                               f"engine does not know: {tuple(view.shape)} at {view.storage_offset()} in "
                               f"{tuple(base.shape)} at {base.storage_offset()}")
        return base, row

    layers = {}
    for layer, (group, keys, values) in views.items():
        rows = min(keys.shape[0], values.shape[0])  # 5.18 on: the values' view is shifted a page further
        layers[layer] = LayerCache(group, *located(keys, rows), *located(values, rows), rows)
    return layers


def batching_config(device: torch.device, *, max_running: int | None, max_batch_tokens: int | None,
                    kv_blocks: int | None, cuda_graphs: bool | None, max_model_len: int,
                    pad_keys_to_cache: bool, prefix_sharing: bool, compile_steps: bool) -> ContinuousBatchingConfig:
    """transformers' batching settings; ``None`` sizes lets it size them (on a GPU). ``pad_keys_to_cache``: every
    step's key slot list is padded to one length (the kernel reads only the real slots), keeping key counts out of
    the graphs' shapes. ``prefix_sharing``: requests share the pages of a common prompt prefix (transformers turns
    it off for models with sliding-window layers); only with the backend's ``prefix_key_of``. ``compile_steps``:
    transformers compiles the step function it captures in graphs (dynamic shapes: one compile serves every padded
    query count; graph breaks allowed: the PyTorch LoRA ops of the CPU reference make some)."""
    cb_config = ContinuousBatchingConfig(
        max_requests_per_batch=max_running,
        max_batch_tokens=max_batch_tokens,
        allow_block_sharing=prefix_sharing,
        use_async_batching=False,
        # transformers would turn graphs on for a CPU model on a machine with a GPU (it asks the machine)
        use_cuda_graph=cuda_graphs if device.type == "cuda" else False,
    )
    if compile_steps:
        # mode "default": the graphs are transformers' (CompileConfig's own default mode would capture its own)
        cb_config.varlen_compile_config = CompileConfig(fullgraph=False, dynamic=True, mode="default")
    if pad_keys_to_cache:
        cb_config.kv_padding_interval_size = ONE_KV_PADDING
    if kv_blocks is None and device.type == "cpu":
        kv_blocks = math.ceil(max_running * max_model_len / page_size(cb_config))
    cb_config.num_blocks = kv_blocks
    return cb_config


def page_size(cb_config: ContinuousBatchingConfig) -> int:
    """Tokens per KV page (``page_size`` since transformers 5.18, ``block_size`` before)."""
    return getattr(cb_config, "page_size", None) or cb_config.block_size


class ContinuousBatchingBackend:
    """transformers' batch processor, extended and driven step by step by the engine (one thread).

    A step: ``prepare()`` schedules the next batch (dropping cancelled requests); ``forward()`` queues it on the
    device; ``deliver_outputs()`` hands the previous step's tokens to ``on_tokens(request_id, generated, finished)``
    / ``on_failure(request_id, error)``; ``rows()`` / ``scores()`` / ``set_tokens()`` let the engine re-sample rows;
    ``fetch_outputs()`` waits for the device and ``end_step()`` advances the requests (``fail_step(error)`` instead,
    when the step raised). ``close()`` gives the model back its attention implementation.
    """

    def __init__(self, hf_model, cb_config: ContinuousBatchingConfig, *, eos_token_ids: list[int],
                 vocab_size: int, slot_of: Callable[[str], tuple[int, int]],
                 prefix_key_of: Callable[[str], PrefixKey | None],
                 on_tokens: Callable[[str, list[int], bool], None], on_failure: Callable[[str, object], None],
                 attention: str | None, attention_forward: Callable):
        self.hf_model = hf_model
        self._own_attention = attention == ATTENTION_NAME
        self._saved_attention = [] if attention is None else set_attention(hf_model, attention, attention_forward)
        self._manager = None
        generation_config = GenerationConfig(  # greedy, no logits processors: the engine samples per request
            do_sample=False,
            eos_token_id=eos_token_ids or -1,
            pad_token_id=getattr(hf_model.generation_config, "pad_token_id", None),
        )
        try:
            self._manager = hf_model.init_continuous_batching(generation_config=generation_config,
                                                              continuous_batching_config=cb_config)
            # upstream hook: init_continuous_batching taking the batch processor's IO, runner and router classes
            processor = self._manager._create_batch_processor()
            _AdapterSlotIOs.adopt(processor.inputs_and_outputs, slot_of, self._own_attention)
            _EngineCache.adopt(processor.cache, self._own_attention, prefix_key_of)
            _ScoreKeepingRunner.adopt(processor.model_runner, processor.cb_config.max_requests_per_batch, vocab_size)
            self._router = processor.output_router = _OutputRouter(on_tokens, on_failure)
            self._manager.batch_processor = processor
        except BaseException:
            self.close()
            raise
        self._processor = processor
        self._io: _AdapterSlotIOs = processor.inputs_and_outputs
        self._runner: _ScoreKeepingRunner = processor.model_runner
        # CUDA events around each step's forward, for its device time (None: not on CUDA, or the step failed)
        self._step_events = None
        if self._io.device.type == "cuda":
            self._step_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self._step_timed = False

    # ------------------------------------------------------------------ sizes and counters
    @property
    def max_requests(self) -> int:
        return self._processor.cb_config.max_requests_per_batch

    @property
    def page_size(self) -> int:
        return page_size(self._processor.cb_config)

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV cache holds."""
        return self._processor.cb_config.num_blocks * self.page_size

    @property
    def waiting(self) -> int:
        """Requests in transformers' scheduler that have not started yet."""
        return len(self._processor.scheduler.waiting_requests)

    @property
    def running(self) -> int:
        return len(self._processor.scheduler.active_requests)

    @property
    def kv_free_fraction(self) -> float:
        """The KV cache's free fraction, pages kept only for prefix sharing counted free (given back on demand)."""
        cache = self._processor.cache
        if hasattr(cache, "compute_free_capacity"):  # transformers >= 5.18
            cached_bytes = sum(len(allocator.ledger.cached_blocks) * allocator.bytes_per_block
                               for allocator in cache.cache_allocators.values())
            free_bytes = cache.compute_free_capacity(relative=False) + cached_bytes
            return float(free_bytes / (cache.num_sectors * cache.bytes_per_sector))
        return cache.get_num_free_blocks() / cache.num_blocks  # 5.17 counts kept pages free itself

    @property
    def prefix_hit_tokens(self) -> int:
        """Prompt tokens whose keys and values came from pages other requests had filled."""
        return self._processor.cache.prefix_hit_tokens

    @property
    def cuda_graphs(self) -> int:
        """Step shapes captured so far."""
        return len(self._io.captured_keys)

    @property
    def compiles_steps(self) -> bool:
        """Whether transformers runs each step through ``torch.compile`` (``batching_config(compile_steps=True)``)."""
        # upstream hook: a public flag for the runner's compiled path
        return self._runner._compiled_varlen is not None

    @property
    def graphs_on(self) -> bool:
        """Whether steps run padded (replayed from CUDA graphs, or compiled)."""
        return self._runner.pad_inputs

    # ------------------------------------------------------------------ requests
    def add(self, request_id: str, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: list[int]) -> None:
        self._manager.add_request(prompt_ids, request_id=request_id, max_new_tokens=max_new_tokens, streaming=True,
                                  eos_token_id=eos_token_ids)

    def cancel(self, request_id: str) -> None:
        """Drop a request at the next ``prepare()``, freeing its KV blocks."""
        self._manager.cancel_request(request_id)

    # ------------------------------------------------------------------ one step
    def prepare(self) -> bool:
        """Schedule the next batch; False when no request is ready to run."""
        return self._processor.prepare_next_batch()

    @property
    def batch_shape(self) -> tuple[int, int, int]:
        """(requests, packed tokens, key tokens: every request's cached and new tokens, which its attention reads)
        of the prepared batch."""
        batch = self._io.requests_in_batch
        return len(batch), sum(s.query_length for s in batch), self._io.step_key_tokens

    def forward(self) -> None:
        """Queue the prepared batch's forward (and greedy tokens) on the device."""
        self._step_timed = False
        batch_data = self._io.get_model_kwargs(use_padding=self._runner.pad_inputs)
        if self._step_events is None:
            self._runner.compute_batch(self.hf_model, batch_data)
            return
        start, end = self._step_events
        with self.on_compute_stream():
            start.record()
        self._runner.compute_batch(self.hf_model, batch_data)
        with self.on_compute_stream():
            end.record()
        self._step_timed = True

    def step_device_seconds(self) -> float | None:
        """The last step's forward on the GPU, from its first kernel to its greedy tokens (after
        ``fetch_outputs``); None on other devices or when the step failed."""
        if not self._step_timed:
            return None
        start, end = self._step_events
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def deliver_outputs(self, request_ids: Collection[str] | None = None) -> None:
        """Hand out the last step's outputs (``request_ids``: those of these requests only, the others kept)."""
        self._router.deliver_pending(request_ids)

    def rows(self) -> list[str]:
        """The request of each row of the step's scores (the batch's requests that get a token this step)."""
        return [f.state.request_id for f in self._io.requests_in_batch if f.has_new_token]

    def scores(self, rows: int) -> torch.Tensor:
        """The step's float32 scores ``[rows, V]``."""
        return self._runner.kept_scores[:rows]

    def on_compute_stream(self):
        """Where work on the step's outputs goes: the stream the step runs on."""
        stream = self._io.compute_stream
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def set_tokens(self, rows: list[int], tokens: torch.Tensor) -> None:
        """Replace the greedy tokens of ``rows`` by ``tokens`` ``[len(rows)]`` (before ``fetch_outputs``)."""
        output_ids = self._io.output_ids
        output_ids[0, torch.tensor(rows, device=output_ids.device)] = tokens.to(output_ids.dtype)

    def fetch_outputs(self) -> None:
        self._io.retrieve_device_outputs()

    def end_step(self) -> None:
        self._processor.update_batch()

    def fail_step(self, error: Exception) -> None:
        """The step raised: its requests fail (through ``on_failure``); the others go on."""
        self._processor.handle_batch_error(error)

    def drop_graphs(self) -> None:
        """Forget the captured CUDA graphs (the model changed under them): steps capture again."""
        if getattr(self._io, "graphs", None) is not None:
            self._io.graphs = type(self._io.graphs)()  # upstream hook: a public way to clear the graph buffer
        self._io.captured_keys.clear()

    # ------------------------------------------------------------------ warm-up and end
    def warm_up(self) -> None:
        """Capture the CUDA graphs of the step shapes known in advance; a failed capture raises, naming the memory.

        transformers' own warm-up runs one request as long as the whole KV cache: right for its attention paths,
        whose graphs need room for a copy of the cache, but ours reads the cache in place and would attend over
        every slot. Ours captures the largest step first (its memory pool then holds every smaller one), then every
        smaller padded query count, each over one page of cached tokens: the kernel reads the cache in place, so the
        graphs are keyed by query count (not key count), and no step captures a graph while requests wait.
        Every shape is captured twice: with the LoRA layers' kernels, and without them for steps in which no token
        has an adapter (``_AdapterSlotIOs.step_has_adapter``).
        transformers logs a failed capture and goes on; here each capture is checked: the forward raised nothing
        (``_ScoreKeepingRunner.compute_batch``) and stored its graph (``_AdapterSlotIOs.set_graph``).
        """
        runner, io, cb_config = self._runner, self._io, self._processor.cb_config
        runner.last_error = None
        failure = None
        # transformers runs each capture's first forward (where a compiled step compiles) inside a memory-pool
        # context of the CUDA allocator; a garbage collection there frees tensors of other pools, and once aborted
        # the process: collections wait until the captures are done.
        collecting = gc.isenabled()
        gc.disable()
        try:
            if not self._own_attention:
                for with_adapters in (True, False):
                    io.warm_up_adapter_path = with_adapters
                    stored = io.graphs_stored
                    self._processor.warmup(self.hf_model)
                    if runner.last_error is not None:
                        failure = str(runner.last_error)
                    elif runner.pad_inputs and runner.use_cuda_graph_varlen and io.graphs_stored == stored:
                        failure = "transformers' warm-up captured no graph"
                    if failure is not None:
                        break
            elif runner.pad_inputs:  # graphs on
                interval, max_batch_tokens = cb_config.q_padding_interval_size, self._processor.cache.max_batch_tokens
                padded = range(interval, max_batch_tokens + interval, interval)  # what the runner pads up to
                sizes = {max_batch_tokens} | {min(size, max_batch_tokens) for size in padded}
                failure = self._warm_up_sizes(sorted(sizes, reverse=True))  # the largest first
        finally:
            io.warm_up_adapter_path = False
            if collecting:
                gc.enable()
        if failure is not None:
            if self.compiles_steps:  # the compiler may be what failed: say how to run without it
                raise RuntimeError(f"warm-up of the compiled step failed: {failure} (EngineConfig(compile_steps="
                                   f"False), or --compile-steps off, runs it uncompiled; {self._memory_report()})")
            raise RuntimeError(f"CUDA graph warm-up failed: {failure} ({self._memory_report()})")

    def _warm_up_sizes(self, sizes: list[int]) -> str | None:
        """Capture the graphs of each padded query count in ``sizes``, with and without the adapter path; returns
        what failed, None if nothing did."""
        runner, io = self._runner, self._io
        for num_q_tokens in sizes:
            for with_adapters in (True, False):
                io.warm_up_adapter_path = with_adapters
                stored = io.graphs_stored
                runner.run_one_warmup(self.hf_model, num_q_tokens=num_q_tokens, max_kv_read=self.page_size)
                if runner.last_error is not None or (runner.use_cuda_graph_varlen and io.graphs_stored == stored):
                    path = "with" if with_adapters else "without"
                    return f"no graph for {num_q_tokens} tokens per step ({path} adapters)" + (
                        f": {runner.last_error}" if runner.last_error is not None else "")
        return None

    def _memory_report(self) -> str:
        """The GPU's memory in words, for a failed warm-up."""
        cache = self._processor.cache
        memory = ""
        if self._io.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self._io.device)
            memory = f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB with "
        return (f"{memory}a KV cache of {cache.num_blocks} blocks and {cache.max_batch_tokens} tokens per step; give "
                f"EngineConfig fewer kv_blocks or max_batch_tokens")

    def close(self) -> None:
        """Give the model back the attention implementation it had before."""
        # upstream hook: a public "stop continuous batching and restore the model" on the manager
        if self._manager is not None and self._manager._original_attn_impl is not None:
            self.hf_model.set_attn_implementation(self._manager._original_attn_impl)
            self._manager._original_attn_impl = None
        restore_attention(self._saved_attention)
        self._saved_attention = []


# ---------------------------------------------------------------------- transformers extension points
class _AdapterSlotIOs(ContinuousBatchingIOs):
    """transformers' batch inputs plus ``adapter_ids`` ``[1, T]``: the GPU adapter slot of every packed token.

    On the engine's own attention path it also builds the keys' cache slots (``read_index``) on the device from
    each request's pages: transformers lists every key of every request in Python, a host cost that grows with
    the batch's keys; this costs a list of pages per request and a few kernels. Graphs are keyed by query count
    (and ``step_has_adapter``), not by key count: the kernel reads each sequence's keys in place through
    ``cu_seq_lens_k``, and the slot lists are padded to the whole cache (``ONE_KV_PADDING``), so the key counts are
    no part of its shapes.
    """

    _slot_of: Callable[[str], tuple[int, int]]  # request id -> (its adapter's slot, the first position it applies to)
    _token_slots: torch.Tensor  # [max_batch_tokens] int32 on the model's device; -1 = base model / padding
    # Whether a token of the prepared step has an adapter. A step with none runs the base model alone (no LoRA
    # kernels, which would only find no adapter token), from graphs of its own: the flag is part of the graph key.
    step_has_adapter: bool
    warm_up_adapter_path: bool  # set by the warm-up: capture the adapter path though its requests have no adapter
    _page_groups: list[_PageGroup] | None  # one per attention group; None: transformers builds the key slots
    captured_keys: set[tuple[int, ...]]  # the step shapes whose graphs are stored
    graphs_stored: int  # graphs stored so far (a capture that failed stores none)
    step_key_tokens: int  # the prepared step's requests' cached and new tokens

    @classmethod
    def adopt(cls, io: ContinuousBatchingIOs, slot_of: Callable[[str], tuple[int, int]], own_attention: bool) -> None:
        if type(io) is not ContinuousBatchingIOs:
            raise TypeError(f"expected transformers' synchronous ContinuousBatchingIOs, got {type(io).__name__}")
        io.__class__ = cls  # upstream hook: the IO class as an argument of the batch processor
        io._slot_of = slot_of
        io._token_slots = torch.full((io.cache.max_batch_tokens,), -1, dtype=torch.int32, device=io.device)
        io._page_groups = _page_groups(io.cache) if own_attention else None
        io.step_has_adapter = io.warm_up_adapter_path = False
        io.step_key_tokens = 0
        io.captured_keys = set()
        io.graphs_stored = 0

    # upstream hook: a per-token extra input (adapter ids) and a key-slot builder in prepare_batch_tensors
    def prepare_batch_tensors(self, requests_in_batch, logits_processors, use_decode_fast_path: bool,
                              num_q_tokens: int, max_kv_read: int, use_padding: bool) -> None:
        past_lengths = [s.state.position_offset for s in requests_in_batch]  # before they advance
        key_lengths = [past + s.query_length for past, s in zip(past_lengths, requests_in_batch)]
        self.step_key_tokens = sum(key_lengths)
        own_key_slots = self._page_groups is not None and max_kv_read > 0 and not use_decode_fast_path
        super().prepare_batch_tensors(requests_in_batch, logits_processors, use_decode_fast_path, num_q_tokens,
                                      0 if own_key_slots else max_kv_read, use_padding)  # 0: it lists no keys
        if own_key_slots:
            self.max_kv_read = max_kv_read
            self._fill_key_slots([s.state.request_id for s in requests_in_batch], key_lengths)
        slots, has_adapter = [], self.warm_up_adapter_path
        for future_state, past_length in zip(requests_in_batch, past_lengths):
            slot, first_position = self._slot_of(future_state.state.request_id)
            # the step's tokens sit at positions past_length on; those before the adapter's first run as the base
            before = min(max(first_position - past_length, 0), future_state.query_length)
            slots += [-1] * before + [slot] * (future_state.query_length - before)
            has_adapter = has_adapter or (slot >= 0 and before < future_state.query_length)
        self.step_has_adapter = has_adapter
        if has_adapter:  # else the forward reads no slot
            self._token_slots[: len(slots)] = torch.tensor(slots, dtype=torch.int32, device=self.device)
            self._token_slots[len(slots) : max(self.num_q_tokens, len(slots))] = -1  # padding up to a graph's size
        if self.compute_stream is not None:  # the step runs there: after the inputs written on this stream
            self.compute_stream.wait_stream(torch.cuda.current_stream(self.device))

    def _fill_key_slots(self, request_ids: list[str], key_lengths: list[int]) -> None:
        """``read_index_storage[g, :total]``: every request's keys' slots in order (full attention: all its tokens,
        those of this step included): transformers' own lists, built on the device. The padding past them is left
        as it is: the attention reads no slot past ``cu_seq_lens_k``."""
        total = sum(key_lengths)
        lengths = torch.tensor(key_lengths, device=self.device)
        starts = lengths.cumsum(0) - lengths
        rows = torch.repeat_interleave(torch.arange(len(key_lengths), device=self.device), lengths, output_size=total)
        positions = torch.arange(total, device=self.device) - starts[rows]
        for index, group in enumerate(self._page_groups):
            pages = [group.owner.block_table[request_id] for request_id in request_ids]
            width = max(map(len, pages))
            flat = array("q")  # one flat buffer: half the host time of a nested list at 100+ requests
            for request_pages in pages:
                flat.extend(request_pages)
                flat.extend(repeat(0, width - len(request_pages)))
            # every request of the step holds a page at least (its new tokens'): the buffer is never empty
            page_table = torch.frombuffer(flat, dtype=torch.int64).view(len(pages), width).to(self.device)
            page_starts = page_table[rows, positions // group.tokens_per_page] * group.page_stride
            self.read_index_storage[index, :total] = page_starts + positions % group.tokens_per_page
            self.true_read_sizes[index] = total

    # upstream hook: a graph-key function in ContinuousBatchingConfig
    def _get_graph_key(self) -> tuple[int | bool, ...]:
        if self._page_groups is not None and not self.use_block_table:
            return self.num_q_tokens, self.step_has_adapter
        return *super()._get_graph_key(), self.step_has_adapter

    def set_graph(self, graph) -> None:
        super().set_graph(graph)
        self.captured_keys.add(self._get_graph_key())
        self.graphs_stored += 1

    def get_model_kwargs(self, *args, **kwargs):
        model_kwargs = super().get_model_kwargs(*args, **kwargs)
        if self.step_has_adapter:  # without adapter_ids the wrapped model runs the base model alone
            # [1, T] with strides (T, 1) whatever T: a compiled step meets the same strides at every size
            tokens = model_kwargs["input_ids"].shape[1]
            model_kwargs["adapter_ids"] = self._token_slots[:tokens].view(1, tokens)
        return model_kwargs


class _EngineCache(PagedAttentionCache):
    """transformers' paged cache with the engine's two changes.

    Prefix sharing keyed by adapter: transformers hashes each full page from its tokens and its parent page's hash,
    and a new request takes the pages of its prompt's longest hashed prefix. Keys and values depend on the adapter
    as well, so in the tokens a request's pages are hashed from (and matched against), the two at the first
    position its adapter computes are replaced by values made from its adapter's registration and those tokens
    (``prefix_key_of(request_id)``; None for the base model: its tokens as they are). Those values are negative,
    never a token id, so an adapter's pages are never taken for the base model's, and another adapter, or another
    load of the same name, meets a different pair (62 bits). Each page's hash covers its parents', so every page
    from that position on is the adapter's; the pages wholly before it (an aLoRA request's prompt before its
    invocation, which the adapter leaves to the base model) are hashed as the base model's and shared with it.

    ``update`` (the 5.18 layout on, with the engine's attention): from transformers 5.24 the models' attention
    modules call ``cache.update(key, value, layer_idx, kwargs)`` before the attention function, and transformers'
    update copies every key and value the step reads out of the cache into new tensors (at every layer of every
    step). Here it copies nothing: it puts the cache into the attention function's ``kwargs``, as 5.17 to 5.23 hand
    it there themselves, so on every version the attention function writes the step's new keys and values and
    reads the others where they lie, through the slot lists. Up to 5.23 no one calls it while the engine's
    attention runs (transformers' own attention functions call it).
    """

    _reads_in_place: bool
    layer_caches: dict[int, LayerCache]  # with the engine's attention: where each layer's keys and values lie
    _prefix_key_of: Callable[[str], PrefixKey | None]
    prefix_hit_tokens: int  # prompt tokens served from shared pages so far

    @classmethod
    def adopt(cls, cache: PagedAttentionCache, own_attention: bool,
              prefix_key_of: Callable[[str], PrefixKey | None]) -> None:
        if type(cache) is not PagedAttentionCache:
            raise TypeError(f"expected transformers' PagedAttentionCache, got {type(cache).__name__}")
        # upstream hook: a cache class (or block-hash salt per request) as an argument of the batch processor
        cache.__class__ = cls
        cache._reads_in_place = own_attention and hasattr(cache, "layer_to_allocator")  # 5.17 reads in place as is
        cache._prefix_key_of = prefix_key_of
        cache.prefix_hit_tokens = 0
        cache.layer_caches = _layer_caches(cache) if own_attention else {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        step = args[0] if args else kwargs.get("kwargs")  # 5.24 on: the attention call's kwargs, updated in place
        # flash-attn's decode path (block tables) and transformers' own attention functions: transformers' update
        if not self._reads_in_place or step is None or step.get("block_table") is not None:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        step["cache"] = self
        return key_states, value_states

    # upstream hook: the paged cache answering the cache API the models call (OPT's forward asks every step)
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """0: a packed step's requests each have their own length, and the step gives each token's position; OPT
        reads this only to make the positions it is given (``position_ids``)."""
        return 0

    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        matched = super().search_prefix_match(request_id, self._keyed(request_id, prompt_ids))
        self.prefix_hit_tokens += matched
        return matched

    # transformers calls these for every request of every step; most steps complete no page, and keying a request's
    # tokens copies all of them: only for a step that completes one (transformers does nothing for the others)
    def mark_complete_blocks(self, state, complete_blocks: dict[str, int]) -> None:  # transformers >= 5.18
        if complete_blocks:
            super().mark_complete_blocks(self._keyed_state(state), complete_blocks)

    def mark_shareable_blocks_as_complete(self, state, num_complete_blocks: int) -> None:  # transformers 5.17
        if num_complete_blocks:
            super().mark_shareable_blocks_as_complete(self._keyed_state(state), num_complete_blocks)

    def _keyed(self, request_id: str, tokens: list[int]) -> list[int]:
        prefix_key = self._prefix_key_of(request_id)
        if prefix_key is None:
            return tokens
        key, start = prefix_key
        if start >= len(tokens):  # no token the adapter computes yet: the base model's pages
            return tokens
        digest = hashlib.blake2b(f"{key}:{tokens[start:start + 2]}".encode(), digest_size=8).digest()
        salt = [-1 - (int.from_bytes(digest[:4], "little") & 0x7FFFFFFF),  # int32, as transformers packs tokens
                -1 - (int.from_bytes(digest[4:], "little") & 0x7FFFFFFF)]
        return [*tokens[:start], *salt[: len(tokens) - start], *tokens[start + 2 :]]

    def _keyed_state(self, state) -> "_KeyedTokens":
        return _KeyedTokens(state, self._keyed(state.request_id, state.initial_tokens + state.generated_tokens))


class _KeyedTokens:
    """A request's state as the page hashes see it (``_EngineCache``): its tokens keyed by its adapter, the rest
    its own."""

    def __init__(self, state, tokens: list[int]) -> None:
        self._state = state
        self.initial_tokens = tokens
        self.generated_tokens: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self._state, name)


class _ScoreKeepingRunner(ModelRunner):
    """transformers' model runner (greedy) that also leaves each step's scores in ``kept_scores`` ``[R, V]``, and
    the error of its last failed step in ``last_error`` (transformers' warm-up logs it and goes on)."""

    kept_scores: torch.Tensor
    last_error: Exception | None

    @classmethod
    def adopt(cls, runner: ModelRunner, max_rows: int, vocab_size: int) -> None:
        runner.__class__ = cls  # upstream hook: the runner class as an argument of the batch processor
        runner.last_error = None
        device = runner.inputs_and_outputs.device
        runner.kept_scores = torch.zeros(max_rows, vocab_size, dtype=torch.float32, device=device)

    def compute_batch(self, model, batch_data: dict) -> None:
        try:
            super().compute_batch(model, batch_data)
        except Exception as error:
            self.last_error = error
            raise

    # upstream hook: an option to keep the step's scores (output_scores) in continuous batching
    def _sample(self, scores: torch.Tensor, output_ids: torch.Tensor) -> None:
        self.kept_scores[: scores.shape[1]].copy_(scores[0])  # scores [1, rows, V]; a static copy, graphable
        super()._sample(scores, output_ids)


class _OutputRouter:
    """Takes the place of transformers' output router: keeps each step's outputs (transformers' copies) until
    ``deliver_pending`` hands them to the engine, once the next step is queued on the device."""

    def __init__(self, on_tokens: Callable[[str, list[int], bool], None], on_failure: Callable[[str, object], None]):
        self._on_tokens = on_tokens
        self._on_failure = on_failure
        self._pending: list = []

    def deliver(self, output) -> None:
        self._pending.append(output)

    def deliver_batch(self, outputs) -> None:
        self._pending.extend(outputs)

    def deliver_pending(self, request_ids: Collection[str] | None = None) -> None:
        """Hand out the kept outputs (``request_ids``: those of these requests only; the others stay kept), each
        request's in order. If a callback raises, the outputs after it stay kept for the next call: a request that
        finished in that step still gets its end."""
        if request_ids is None:
            pending, self._pending = self._pending, []
        else:
            pending = [output for output in self._pending if output.request_id in request_ids]
            self._pending = [output for output in self._pending if output.request_id not in request_ids]
        for index, output in enumerate(pending):
            try:
                if output.error is not None:
                    self._on_failure(output.request_id, output.error)
                else:
                    self._on_tokens(output.request_id, output.generated_tokens, output.is_finished())
            except BaseException:
                self._pending[:0] = pending[index + 1 :]
                raise

    def fail_and_deliver(self, state, error: Exception) -> None:
        self.deliver_pending()  # in order: the request's earlier tokens first
        self._on_failure(state.request_id, error)


@dataclass(frozen=True)
class _PageGroup:
    """Where one attention group's keys lie: the slot of a request's token at ``position`` is
    ``owner.block_table[request_id][position // tokens_per_page] * page_stride + position % tokens_per_page``."""

    owner: object  # transformers' object that holds the group's pages of each request (``block_table``)
    tokens_per_page: int
    page_stride: int


def _page_groups(cache) -> list[_PageGroup]:
    """The cache's attention groups (5.17: group cache managers; 5.18 on: cache allocators, one per layer type)."""
    if hasattr(cache, "cache_allocators"):
        return [_PageGroup(a, a.tokens_per_page, a.block_physical_stride) for a in cache.cache_allocators.values()]
    return [_PageGroup(m, m.block_size, m.block_size) for m in cache.group_cache_managers]


def _configs(hf_model) -> list:
    configs = [hf_model.config]
    text_config = hf_model.config.get_text_config()
    if text_config is not hf_model.config:
        configs.append(text_config)
    return configs
