"""Compile the CUDA kernels ahead of time: ``python -m punica_hf.ops.build [--verbose]``.

Needs nvcc (``CUDA_HOME``, default /usr/local/cuda) and a CUDA build of torch, but no GPU. Targets
``TORCH_CUDA_ARCH_LIST`` when set, else the present GPU, else 9.0. The result lands in the same cache the runtime
loads from.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from . import cuda


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    if torch.version.cuda is None:  # nothing to compile against: say so rather than fail inside the build
        print(f"punica_hf.ops.build: {cuda.NO_CUDA_TORCH}", file=sys.stderr)
        raise SystemExit(2)
    start = time.perf_counter()
    cuda.load_extension(verbose=args.verbose)
    print(f"punica_hf kernels built for arch {cuda.default_arch_list()} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
