"""Run a worker script as 2 ranks under ``torchrun`` (gloo, CPU), bounded, and read back what each rank wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from server_process import child_env


def run_two_ranks(worker: Path, root: Path, timeout_s: float, *worker_args: str, gpus: bool = False) -> list[dict]:
    """``torchrun --nproc-per-node 2 worker ROOT [WORKER_ARGS]``; each rank writes ``ROOT/rank<R>.json``. Fails the
    test with the ranks' log when the run fails, leaves a result out or runs past ``timeout_s`` (its ranks killed
    then). GPUs are hidden unless ``gpus``: the ranks run on the CPU (gloo) wherever the test runs."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(worker), str(root), *worker_args]
    # PYTHONFAULTHANDLER: a rank that crashes (SIGSEGV, SIGABRT) prints its Python stack into the log
    env = {**child_env(), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONFAULTHANDLER": "1"}
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    results = [root / f"rank{rank}.json" for rank in range(2)]
    for attempt in range(2):
        log = root / ("torchrun.log" if attempt == 0 else "torchrun-again.log")
        returncode = _run_bounded(command, env, log, timeout_s)
        text = log.read_text()
        if returncode == 0 and all(path.exists() for path in results):
            break
        # torch's C++ runtime has, rarely, aborted a rank of this harness ("terminate called without an active
        # exception", SIGABRT) in runs that pass alone: once, that run goes again, and the test says so.
        if attempt == 0 and _TORCH_ABORT in text and "SIGABRT" in text:
            warnings.warn(f"a rank aborted in torch's C++ runtime; running {worker.name} again:\n{text[-2000:]}")
            for path in results:
                path.unlink(missing_ok=True)
            continue
        pytest.fail(f"torchrun ended with {returncode}:\n{_crash_stacks(text)}{text[-6000:]}")
    return [json.loads(path.read_text()) for path in results]


_TORCH_ABORT = "terminate called without an active exception"
_CRASH = "Fatal Python error"


def _crash_stacks(log: str, each: int = 3000) -> str:
    """The Python stacks the ranks' fault handler printed when they crashed (they precede the log's tail, which
    torchrun fills with its own report), or "" when none crashed."""
    stacks = []
    start = log.find(_CRASH)
    while start != -1:
        stacks.append(log[start:start + each])
        start = log.find(_CRASH, start + each)
    return "".join(f"{stack}\n...\n" for stack in stacks)


def _run_bounded(command: list[str], env: dict, log: Path, timeout_s: float) -> int:
    with open(log, "w") as output:
        # Its own session, so a timeout ends the ranks with it (killpg), never leaving them behind.
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return process.returncode


def check_engines_ran(ranks: list[dict]) -> None:
    """Fail the test with a rank's traceback, or its engine's error, if one of the ranks wrote one."""
    for rank, seen in enumerate(ranks):
        assert "error" not in seen, f"rank {rank}:\n{seen['error']}"
        assert seen["engine_error"] is None, f"rank {rank}: {seen['engine_error']}"


def finish_rank(root: Path, results: dict) -> None:
    """In a worker: write this rank's ``results`` to ``ROOT/rank<R>.json`` and leave the process group."""
    import torch.distributed as dist

    (root / f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))
    if dist.is_initialized():
        dist.destroy_process_group()
    # Out without the interpreter's teardown, where torch's C++ threads can abort a finished rank
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
