"""``punica-hf generate --tp 2``: the command starts its 2 ranks itself (gloo on the CPU) and prints what the
unsplit model generates, once. Every command runs with the GPUs hidden: on the CPU, as the ranks run."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from helpers import save_peft_adapter, save_word_level_model, tiny_llama
from server_process import child_env

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without torch.distributed")

RUN_TIMEOUT_S = 180


def _generate(model, adapters, *options: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "punica_hf", "generate", "--model", str(model), "--adapter", f"a={adapters['a']}",
               "--prompt", "a:w5 w6 w9", "--prompt", "base:w3 w4", "--prompt", "a:w11", "--max-new-tokens", "6",
               *options]
    env = {**child_env(), "COLUMNS": "200", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S)


def _table_rows(output: str) -> list[str]:
    """The table's rows without their last cell (tokens per second)."""
    return [line.rstrip().rstrip("│").rpartition("│")[0] for line in output.splitlines() if line.startswith("│")]


@pytest.mark.parametrize("options", [[], ["--do-sample", "--seed", "3"]], ids=["greedy", "sampled"])
def test_generate_split_over_two_ranks_prints_the_unsplit_answers_once(tmp_path, options):
    model, adapters = save_word_level_model(tmp_path)
    whole = _generate(model, adapters, *options)
    split = _generate(model, adapters, "--tp", "2", *options)
    assert whole.returncode == 0, whole.stderr
    assert split.returncode == 0, split.stderr
    rows = _table_rows(whole.stdout)
    assert len(rows) == 3, whole.stdout
    assert _table_rows(split.stdout) == rows  # the same answers, printed by rank 0 only


@pytest.mark.parametrize("options, problem", [
    (["--model", "demo"], "--tp splits a transformers model"),
    (["--model", "MODEL", "--device", "cpu"], "--tp places each rank where transformers puts it"),
])
def test_generate_tp_refusals(tmp_path, options, problem):
    options = [str(tmp_path) if option == "MODEL" else option for option in options]
    result = subprocess.run([sys.executable, "-m", "punica_hf", "generate", *options, "--prompt", "base:w3", "--tp",
                             "2"], capture_output=True, text=True, env=child_env(), timeout=60)
    assert result.returncode == 1
    assert problem in result.stderr


@pytest.mark.parametrize("ranks, problem", [
    ("3", "--tp 3 does not divide the model's 4 attention heads"),
    ("4", "--tp 4 does not divide the model's 2 key value heads"),
])
def test_a_tp_that_does_not_divide_the_heads_is_refused_before_the_ranks_start(tmp_path, ranks, problem):
    """Every rank used to load, then fail on a tensor shape ("shape '[1, 2, -1, 8]' is invalid")."""
    model, adapters = save_word_level_model(tmp_path)  # 4 attention heads, 2 key value heads
    result = _generate(model, adapters, "--tp", ranks)
    assert result.returncode == 1 and problem in result.stderr, result.stderr
    assert "torch.distributed" not in result.stderr  # refused before torchrun started


def test_a_failing_rank_fails_the_command_with_a_message(tmp_path):
    model, adapters = save_word_level_model(tmp_path)
    head = save_peft_adapter(tiny_llama(), tmp_path / "head", r=4, target_modules=["lm_head"])
    result = _generate(model, {"a": head}, "--tp", "2")
    assert result.returncode == 1
    assert "output layer (lm_head)" in result.stderr  # the rank's own error
    assert "a rank of --tp 2 failed" in result.stderr and "the others were stopped" in result.stderr
