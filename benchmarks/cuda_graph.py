"""CUDA-graph capture shared by the benchmarks (``bench_step_lora.py``)."""

from __future__ import annotations

import torch


def capture(fn) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``fn``'s launches, captured after two warm-up runs on a side stream (so lazy setup, cuBLAS
    handles and the kernel build happen outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
