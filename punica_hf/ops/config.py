"""Which kernel paths the CUDA ops take: an explicit value passed to every op call, never read from the environment.

A model's config is fixed when it is made (``MultiLoraModel(kernels=...)``); the hooks pass it to each op as
arguments of the op itself, so a compiled step or a captured CUDA graph is keyed by the config it was made with
instead of silently keeping whatever a global switch said at capture time. The defaults are the fastest paths;
the others exist to compare against them (benchmarks) and to test each path (tests/gpu).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class KernelConfig:
    """Kernel choices of the CUDA backend: the LoRA ops' paths (each needs sm_90 or newer; older GPUs ignore it) and
    whether the serving engine runs the base model's norms as one kernel each.

    Attributes:
        programmatic_launch: the two-launch paths start their expand kernel before the shrink ends (programmatic
            dependent launch), so the launch gap overlaps the shrink's tail.
        fused: per-token calls whose factor slices fit shared memory run as one launch of a thread-block cluster
            kernel instead of a shrink and an expand launch.
        short_runs: where the tiled tensor-core path runs (prefill sizes), slots with few tokens go to the
            per-token kernels instead (a tiled block would make one pass per such slot).
        short_run_chunks: with ``short_runs``, the per-token kernels run a grid of two waves that walks the list of
            the short runs' chunks, instead of launching a block for every position of the call (in a mixed step
            most positions are prefill tokens, which the tiled kernels serve).
        fused_norms: while a serving engine runs the model, its RMSNorm modules run as one kernel each instead of
            transformers' eight (``punica_hf.norm_layers``: only the modules whose arithmetic the kernel
            reproduces, checked on each module). Off by default until its GPU tests and its A/B against the
            unfused engine have run on a GPU (benchmarks/gpu_session.sh, parts ``tests serving serving_b``).
    """

    programmatic_launch: bool = True
    fused: bool = True
    short_runs: bool = True
    short_run_chunks: bool = True
    fused_norms: bool = False

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, bool):
                raise ValueError(f"KernelConfig.{field.name} must be a bool, got {value!r}")
