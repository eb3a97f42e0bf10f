"""Session-wide test setup: never reach the network, and make ``tests/helpers.py`` importable."""

import os
import sys
from pathlib import Path

# Set before anything imports huggingface_hub: it reads these once, at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import tiny_llama  # noqa: E402

# The test models are tiny: one intra-op thread is much faster than several fighting for shared cores
# (a [18, 32] x [32, 64] matmul: ~7 us with 1 thread, ~20 ms with 2 on a loaded 2-core machine).
torch.set_num_threads(1)


@pytest.fixture
def tiny_base():
    """A fresh tiny Llama per test (wrapping a model changes it in place)."""
    return tiny_llama()


@pytest.fixture(scope="module")
def base():
    """One unwrapped tiny Llama per test module; tests wrap deep copies of it (or use it as the reference)."""
    return tiny_llama()
