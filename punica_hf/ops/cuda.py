"""The CUDA kernels of ``csrc/``: JIT build/load, and ``CudaLoraBackend``, the LoRA backend the hooks call.

The extension registers the ops ``torch.ops.punica_hf.lora_add`` (mutates ``y``, returns nothing),
``lora_delta`` (a group of projections sharing their input, returns their updates), ``paged_attention`` (see
``ops.attention``) and ``rms_norm`` (see ``ops.norm``); this module adds their fake implementations, so
``torch.compile(fullgraph=True)`` traces through them, and the ops make no host-device sync, so they can be captured
in a CUDA graph. The build is cached in a directory keyed by the sources, the torch and CUDA versions and the target
architectures: it recompiles only when one of them changes.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Sequence
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch

from .config import KernelConfig
from .segments import LoraSegments

_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # punica_hf/
_SOURCE_DIRS = (_PACKAGE_DIR.parent / "csrc", _PACKAGE_DIR / "csrc")  # repo checkout, then installed wheel
_COMPILED_SUFFIXES = (".cu", ".cpp")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # dtypes the kernels take (x, y and pool alike)
MAX_RANK = 1024  # largest max_rank the kernels take
MAX_OUTPUTS = 4  # most projections one lora_delta call computes (PUNICA_MAX_OUTPUTS)

# Why the kernels cannot build under this torch, and what to do about it.
NO_CUDA_TORCH = ("this torch build has no CUDA support: the kernels need a CUDA build of torch "
                 "(pip install torch --index-url https://download.pytorch.org/whl/cu130, or the build for your CUDA)")

_op = None  # torch.ops.punica_hf.lora_add.default once the extension is loaded
_delta_op = None  # torch.ops.punica_hf.lora_delta.default
_attention_op = None  # torch.ops.punica_hf.paged_attention.default
_rms_norm_op = None  # torch.ops.punica_hf.rms_norm.default


def source_dir() -> Path:
    """The ``csrc`` directory holding the kernel sources."""
    for candidate in _SOURCE_DIRS:
        if (candidate / "punica_ops.cpp").is_file():
            return candidate
    raise FileNotFoundError(f"punica_hf kernel sources not found in {[str(d) for d in _SOURCE_DIRS]}")


def default_arch_list() -> str:
    """``TORCH_CUDA_ARCH_LIST`` if set, else the present GPU's architecture, else 9.0 (H100/H200)."""
    requested = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if requested:
        return requested
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}"
    return "9.0"


@contextmanager
def _environment(**values: str):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _build_name(sources: list[Path], arch_list: str) -> str:
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(f"torch={torch.__version__} cuda={torch.version.cuda} arch={arch_list}".encode())
    return f"punica_hf_kernels_{digest.hexdigest()[:16]}"


def build_directory(name: str) -> Path:
    """Where the build named ``name`` lives: ``$PUNICA_HF_CACHE`` or ``~/.cache/punica_hf``."""
    root = os.environ.get("PUNICA_HF_CACHE") or Path.home() / ".cache" / "punica_hf"
    return Path(root) / name


def load_extension(verbose: bool = False) -> None:
    """Build (first time, or after a source change) and load the kernels; raises on any failure."""
    global _op, _delta_op, _attention_op, _rms_norm_op
    if _op is not None:
        return
    if torch.version.cuda is None:
        raise RuntimeError(NO_CUDA_TORCH)
    if "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ and Path("/usr/local/cuda").is_dir():
        os.environ["CUDA_HOME"] = "/usr/local/cuda"  # before cpp_extension reads it at import
    from torch.utils import cpp_extension

    csrc = source_dir()
    sources = sorted(p for p in csrc.iterdir() if p.suffix in _COMPILED_SUFFIXES + (".h", ".cuh"))
    arch_list = default_arch_list()
    name = _build_name(sources, arch_list)
    directory = build_directory(name)
    directory.mkdir(parents=True, exist_ok=True)
    with _environment(TORCH_CUDA_ARCH_LIST=arch_list):
        cpp_extension.load(
            name=name,
            sources=[str(p) for p in sources if p.suffix in _COMPILED_SUFFIXES],
            extra_include_paths=[str(csrc)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "-std=c++17", "-lineinfo"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=verbose,
        )
    _register_fake()
    _delta_op = torch.ops.punica_hf.lora_delta.default
    _attention_op = torch.ops.punica_hf.paged_attention.default
    _rms_norm_op = torch.ops.punica_hf.rms_norm.default
    _op = torch.ops.punica_hf.lora_add.default  # the overload itself: no overload resolution per call; set last


def kernels_available() -> bool:
    """Whether the kernels build and load here (tried once); on failure warns once, naming the error."""
    return _kernels_available()


@lru_cache(maxsize=None)
def _kernels_available() -> bool:
    try:
        load_extension()
    except Exception as error:  # any build or load failure means: use the reference ops
        warnings.warn(
            f"punica_hf: CUDA kernels unavailable, using the PyTorch ops instead ({error}). "
            "Ask for the CUDA backend (PUNICA_HF_BACKEND=cuda or backend='cuda') to make this an error.",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True


def _register_fake() -> None:
    @torch.library.register_fake("punica_hf::lora_add")
    def _lora_add_fake(y, x, pool, a_offsets, b_offsets, lora_ranks, sorted_token_ids, sorted_slots, long_run_slots,
                       short_run_slots, short_run_chunk_starts, max_rank, programmatic_launch, fused, short_runs,
                       short_run_chunks) -> None:
        return None

    @torch.library.register_fake("punica_hf::lora_delta")
    def _lora_delta_fake(x, pool, a_offsets, b_offsets, lora_ranks, sorted_token_ids, sorted_slots, out_features,
                         max_rank, programmatic_launch, fused):
        return x.new_empty(x.shape[0], sum(out_features))

    @torch.library.register_fake("punica_hf::paged_attention")
    def _paged_attention_fake(query, key_cache, value_cache, key_slots, cu_seq_lens_q, cu_seq_lens_k, scale, splits):
        return query.new_empty(query.shape)

    @torch.library.register_fake("punica_hf::rms_norm")
    def _rms_norm_fake(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)


def _check(y: torch.Tensor, x: torch.Tensor, pool: torch.Tensor, a_offsets: torch.Tensor, b_offsets: torch.Tensor,
           lora_ranks: torch.Tensor, segments: LoraSegments, max_rank: int) -> None:
    """ValueError naming the problem for inputs the kernels do not take (static properties only: no sync)."""
    if x.dtype not in DTYPES:
        raise ValueError(f"lora_add: dtype {x.dtype} not supported (float32, float16, bfloat16)")
    if not (y.dtype == x.dtype == pool.dtype):
        raise ValueError(f"lora_add: y, x and pool must share one dtype, got {y.dtype}, {x.dtype}, {pool.dtype}")
    if a_offsets.dtype != torch.int64 or b_offsets.dtype != torch.int64:
        raise ValueError(f"lora_add: a_offsets and b_offsets must be int64, got {a_offsets.dtype}, {b_offsets.dtype}")
    if lora_ranks.dtype != torch.int32:
        raise ValueError(f"lora_add: lora_ranks must be int32, got {lora_ranks.dtype}")
    if x.dim() != 2 or y.dim() != 2 or pool.dim() != 1:
        raise ValueError("lora_add: expected y [T, H_out], x [T, H_in] and a 1-D pool")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"lora_add: y {tuple(y.shape)} and x {tuple(x.shape)} have different token counts")
    num_slots = segments.num_slots
    for name, table in (("a_offsets", a_offsets), ("b_offsets", b_offsets), ("lora_ranks", lora_ranks)):
        if table.shape != (num_slots,):
            raise ValueError(f"lora_add: {name} must have shape [{num_slots}] (the segments' slots), got "
                             f"{tuple(table.shape)}")
    if x.shape[1] % 8 or y.shape[1] % 8:
        raise ValueError(f"lora_add: hidden sizes must be multiples of 8, got {x.shape[1]} -> {y.shape[1]}")
    if not isinstance(max_rank, int) or not 1 <= max_rank <= MAX_RANK:
        raise ValueError(f"lora_add: max_rank must be an int in [1, {MAX_RANK}], got {max_rank!r}")
    if not all(t.is_contiguous() for t in (y, x, pool, a_offsets, b_offsets, lora_ranks)):
        raise ValueError("lora_add: y, x, pool and the offset / rank tables must be contiguous")


class CudaLoraBackend:
    """The kernels as a LoRA backend (``ops.backend_for``), running the paths ``kernels`` chooses.

    ``lora_add(y, x, pool, a_offsets, b_offsets, lora_ranks, segments, max_rank)``: ``y[t] += Bt_s^T @ (A_s @
    x[t])`` in place for tokens whose slot ``s >= 0`` has rank > 0 (shapes and pool layout in ``torch_ops``).
    ``lora_delta(x, pool, a_offsets, b_offsets, lora_ranks, segments, max_rank, out_features)``: the updates of
    ``G <= MAX_OUTPUTS`` projections sharing ``x``, tables ``[G, S]``, a new ``[T, sum(out_features)]`` tensor.

    One or two launches per call, no host sync: capturable in a CUDA graph and traceable by ``torch.compile``; the
    table values (offsets, ranks, slots) are read on the device. The kernel path depends on shapes, dtype,
    ``max_rank`` and ``kernels`` only: per-token chunks for T <= 256 or fp32 (one launch of a thread-block cluster
    kernel on sm_90 where the factor slices fit shared memory, else a shrink and an expand launch), segment-tiled
    tensor cores above, for the slots with more than ``SHORT_RUN_TOKENS`` tokens (the per-token kernels take the
    others, walking the list of their chunks: ``KernelConfig.short_run_chunks``). ``lora_delta`` runs the per-token
    kernels at every ``T`` (grouping pays at decode sizes).

    The checked entries raise ValueError naming the problem. The ``*_unchecked`` ones skip the Python checks: an
    eager forward makes one call per targeted module and spends its time on the host, so the hooks check the static
    properties once (``takes_unchecked``) and call these. The binding still checks devices, shapes, dtypes and
    alignment before any launch and raises ValueError (a wrong table once crashed the process there instead:
    benchmarks/KERNEL_NOTES.md). Builds the kernels when made.
    """

    name = "cuda"

    def __init__(self, kernels: KernelConfig | None = None) -> None:
        self.kernels = KernelConfig() if kernels is None else kernels
        if not isinstance(self.kernels, KernelConfig):
            raise ValueError(f"kernels must be a punica_hf.ops.KernelConfig, got {type(self.kernels).__name__}")
        load_extension()

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"CudaLoraBackend({self.kernels!r})"

    def takes_unchecked(self, dtype: torch.dtype, in_features: int, out_features: int, max_rank: int) -> bool:
        """Whether the unchecked entries take a module of these static properties (else call the checked ones)."""
        return dtype in DTYPES and in_features % 8 == 0 and out_features % 8 == 0 and 1 <= max_rank <= MAX_RANK

    def lora_add(self, y: torch.Tensor, x: torch.Tensor, pool: torch.Tensor, a_offsets: torch.Tensor,
                 b_offsets: torch.Tensor, lora_ranks: torch.Tensor, segments: LoraSegments, max_rank: int) -> None:
        _check(y, x, pool, a_offsets, b_offsets, lora_ranks, segments, max_rank)
        self.lora_add_unchecked(y, x, pool, a_offsets, b_offsets, lora_ranks, segments, max_rank)

    def lora_add_unchecked(self, y: torch.Tensor, x: torch.Tensor, pool: torch.Tensor, a_offsets: torch.Tensor,
                           b_offsets: torch.Tensor, lora_ranks: torch.Tensor, segments: LoraSegments,
                           max_rank: int) -> None:
        """``lora_add`` where the caller guarantees what it checks; ``y`` and ``x`` may have leading token
        dimensions (``[..., H]``, contiguous), which the binding flattens."""
        kernels = self.kernels
        _op(y, x, pool, a_offsets, b_offsets, lora_ranks, segments.sorted_token_ids, segments.sorted_slots,
            segments.long_run_slots, segments.short_run_slots, segments.short_run_chunk_starts, max_rank,
            kernels.programmatic_launch, kernels.fused, kernels.short_runs, kernels.short_run_chunks)

    def lora_delta(self, x: torch.Tensor, pool: torch.Tensor, a_offsets: torch.Tensor, b_offsets: torch.Tensor,
                   lora_ranks: torch.Tensor, segments: LoraSegments, max_rank: int,
                   out_features: Sequence[int]) -> torch.Tensor:
        out_features = [int(width) for width in out_features]
        if not 1 <= len(out_features) <= MAX_OUTPUTS:
            raise ValueError(f"lora_delta: from 1 to {MAX_OUTPUTS} projections per call, got {len(out_features)}")
        if any(width <= 0 or width % 8 for width in out_features):
            raise ValueError(f"lora_delta: every width must be a positive multiple of 8, got {out_features}")
        tables_shape = (len(out_features), segments.num_slots)
        for name, table in (("a_offsets", a_offsets), ("b_offsets", b_offsets), ("lora_ranks", lora_ranks)):
            if table.shape != tables_shape:
                raise ValueError(f"lora_delta: {name} must have shape {list(tables_shape)}, got {tuple(table.shape)}")
        y = torch.empty(x.shape[0], sum(out_features), dtype=x.dtype, device="meta")  # for the shared checks only
        _check(y, x, pool, a_offsets[0], b_offsets[0], lora_ranks[0], segments, max_rank)
        if not all(t.is_contiguous() for t in (a_offsets, b_offsets, lora_ranks)):
            raise ValueError("lora_delta: the offset / rank tables must be contiguous")
        return self.lora_delta_unchecked(x, pool, a_offsets, b_offsets, lora_ranks, segments, max_rank, out_features)

    def lora_delta_unchecked(self, x: torch.Tensor, pool: torch.Tensor, a_offsets: torch.Tensor,
                             b_offsets: torch.Tensor, lora_ranks: torch.Tensor, segments: LoraSegments,
                             max_rank: int, out_features: list[int]) -> torch.Tensor:
        """``lora_delta`` where the caller guarantees what it checks (``out_features`` a list of ints)."""
        kernels = self.kernels
        return _delta_op(x, pool, a_offsets, b_offsets, lora_ranks, segments.sorted_token_ids,
                         segments.sorted_slots, out_features, max_rank, kernels.programmatic_launch, kernels.fused)
