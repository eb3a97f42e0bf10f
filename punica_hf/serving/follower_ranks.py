"""The ranks 1.. of a tensor-parallel group as child processes of rank 0's process, which starts them, joins them
through torch.distributed's rendezvous, watches them and never lets them outlive it. A Ray Serve replica over
``--tp K`` ranks runs them (``serving.ray``)."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures

import torch
import torch.distributed as dist

from .engine import Engine

FOLLOWER_WATCH_SECONDS = 0.2  # how often rank 0, joining its group, checks that the other ranks live
PR_SET_PDEATHSIG = 1  # Linux prctl(2): the signal a process gets when the thread that started it ends


class FollowerRanks:
    """The ranks 1.. of a replica's tensor-parallel group: child processes of the replica's process, which is rank 0.

    The children die with the replica's process however it ends: Linux's ``PR_SET_PDEATHSIG`` has the kernel kill
    a child when the thread that started it ends, here the replica's event-loop thread, which lives as long as the
    process (Ray's raylet also ends a dead worker's process group, when the raylet itself still runs). They take the
    replica's GPUs: they inherit the ``CUDA_VISIBLE_DEVICES`` Ray gave the replica, and transformers puts rank i on
    the i-th (``LOCAL_RANK``).
    """

    def __init__(self, ranks: int, follower_args: Sequence[str]) -> None:
        port = _free_port()  # free now; rank 0 listens on it when it joins, right after
        self.address = f"tcp://127.0.0.1:{port}"
        self.ranks = ranks
        # PYTHONPATH: what this process imports from, punica_hf included, wherever Ray put it (a runtime_env's
        # working_dir is on sys.path, not in the environment).
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(ranks),
               "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        die_with_parent = _death_signal_on_parent_exit()
        self.processes: dict[int, subprocess.Popen] = {}
        try:
            for rank in range(1, ranks):
                self.processes[rank] = subprocess.Popen(
                    [sys.executable, *follower_args], env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    preexec_fn=die_with_parent,
                )
        except BaseException:
            self.stop(timeout=0)
            raise

    def join_and(self, make_engine: Callable[[], Engine]) -> Engine:
        """Join the group as rank 0, then ``make_engine()``; a ``RuntimeError`` as soon as a follower exits
        meanwhile (rank 0 would wait for it for good)."""
        outcome: futures.Future = futures.Future()

        def join_and_make() -> None:
            try:
                # The followers' backend (punica_hf.cli.ranks.join): NCCL on GPUs, gloo on the CPU.
                backend = "nccl" if torch.cuda.is_available() else "gloo"
                dist.init_process_group(backend, init_method=self.address, rank=0, world_size=self.ranks)
                outcome.set_result(make_engine())
            except BaseException as error:
                outcome.set_exception(error)

        threading.Thread(target=join_and_make, name="punica-hf-rank-0-start", daemon=True).start()
        while not futures.wait([outcome], timeout=FOLLOWER_WATCH_SECONDS).done:
            self.check()
        return outcome.result()

    def check(self) -> None:
        """``RuntimeError`` naming a follower that has exited (the group cannot go on without it)."""
        for rank, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"rank {rank} of this replica's tensor-parallel group exited (exit code "
                                   f"{process.returncode}); Ray Serve replaces the replica")

    def stop(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the followers to exit (rank 0's engine tells them to stop once it has
        drained), then kill those left."""
        deadline = time.monotonic() + timeout
        for process in self.processes.values():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _death_signal_on_parent_exit() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child killed when the thread starting it ends (Linux ``PR_SET_PDEATHSIG``);
    None elsewhere. libc is looked up here, before the fork: the child runs no import between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def set_death_signal() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the signal was set
            os.kill(os.getpid(), signal.SIGKILL)

    return set_death_signal


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
