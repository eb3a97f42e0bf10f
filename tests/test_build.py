"""The CUDA kernels compile (no GPU needed): a kernel that does not build never lands."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from punica_hf.ops import build


def _nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = Path(cuda_home) / "bin" / "nvcc"
    return str(candidate) if candidate.is_file() else shutil.which("nvcc")


@pytest.mark.nvcc
@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")
@pytest.mark.skipif(torch.version.cuda is None, reason="this torch build has no CUDA support")
def test_kernels_compile(tmp_path):
    env = dict(os.environ)
    env["TORCH_CUDA_ARCH_LIST"] = "9.0"  # one architecture keeps CI short
    env["PUNICA_HF_CACHE"] = str(tmp_path)  # a fresh build, not a cached one
    result = subprocess.run(
        [sys.executable, "-m", "punica_hf.ops.build"],
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, f"build failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    assert "built for arch" in result.stdout


def test_build_without_cuda_torch_says_so_in_one_line(monkeypatch, capsys, tmp_path):
    """On a CPU-only torch the build cannot run: one line naming what is missing and how to get it, exit status 2,
    and nothing built (no traceback from inside the compiler toolchain)."""
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setenv("PUNICA_HF_CACHE", str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        build.main([])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "CUDA build of torch" in lines[0] and "pip install torch" in lines[0], captured.err
    assert captured.out == "" and not any(tmp_path.iterdir())
