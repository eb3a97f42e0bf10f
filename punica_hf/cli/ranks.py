"""``--tp N``: one command runs a model split over N ranks by transformers' tensor parallelism.

The command the user typed starts N copies of itself as one ``torchrun`` group (``python -m torch.distributed.run
--standalone``, marked by a hidden ``--as-tp-rank`` option) and waits for them. Each rank joins the group (NCCL on
GPUs, gloo on the CPU: where transformers places the ranks), loads the model split (``DistributedConfig(tp_plan="auto")``) and the adapters, and runs the
same calls; only rank 0 prints. When a rank fails, torchrun stops the others and the command fails with a message
saying so, never hanging. A SIGTERM or SIGINT to the command goes on to torchrun, which passes it to every rank.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys

import torch
import torch.distributed as dist
from transformers import AutoConfig

from .common import DEMO_MODEL, positive_int

RANK_OPTION = "--as-tp-rank"
# How long torchrun lets its ranks stop once it has passed a signal on, before it kills them (torchrun's setting)
TORCHRUN_STOP_VARIABLE = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


def add_tp_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tp", type=positive_int, default=1, metavar="N",
        help="split the model over N ranks with transformers' tensor parallelism (N GPUs, or N processes on the "
        "CPU); the command starts them itself (default: 1, no split)",
    )
    parser.add_argument(RANK_OPTION, action="store_true", help=argparse.SUPPRESS)


def check_tp_arguments(args: argparse.Namespace) -> None:
    """Refuse what ``--tp`` cannot split or place, before anything loads."""
    if args.model == DEMO_MODEL:
        raise ValueError("--tp splits a transformers model; the demo model is not split (leave out --tp)")
    if args.device != "auto":
        raise ValueError(
            "--tp places each rank where transformers puts it (rank N on GPU N, or the CPU on a machine without "
            "GPUs); leave out --device"
        )
    _check_heads_split(args.model, args.tp)


def _check_heads_split(model_id: str, ranks: int) -> None:
    """Each rank takes an equal share of the attention heads: refuse a ``--tp`` that does not divide them (the ranks
    would fail on a tensor shape). A model whose config cannot be read here is left to the load to refuse."""
    try:  # from disk only: a Hub model not downloaded yet is not waited for here (its ranks download it)
        config = AutoConfig.from_pretrained(model_id, local_files_only=True).get_text_config()
    except (OSError, ValueError):
        return
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None)
        if isinstance(heads, int) and heads % ranks:
            what = name.removeprefix("num_").replace("_", " ")
            raise ValueError(f"--tp {ranks} does not divide the model's {heads} {what}: each rank takes an equal "
                             "share of them")


def launch(argv: list[str], ranks: int, stop_seconds: int | None = None) -> None:
    """Run the command line ``argv`` again as ``ranks`` processes of one torchrun group and wait for them all.

    ``stop_seconds``: how long the ranks may take to stop once signalled, before torchrun kills them (torchrun's
    default is 30 s; releases of torch whose torchrun does not read ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` keep it)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "punica_hf", *argv, RANK_OPTION]
    environment = None if stop_seconds is None else {**os.environ, TORCHRUN_STOP_VARIABLE: str(int(stop_seconds))}
    process = subprocess.Popen(command, env=environment)
    terminated = []

    def pass_on(signum, _frame) -> None:  # to torchrun, which signals every rank (a server then drains)
        terminated.append(signum)
        process.send_signal(signum)

    # SIGINT too: one sent to this process alone (not a terminal's Ctrl-C, which reaches every rank) would
    # otherwise end it and leave torchrun and the ranks running
    previous = {signum: signal.signal(signum, pass_on) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        returncode = process.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if signal.SIGINT in terminated:
        raise KeyboardInterrupt  # every rank has stopped: the command ends as interrupted
    if returncode != 0 and not terminated:
        raise RuntimeError(
            f"a rank of --tp {ranks} failed (exit code {returncode}); the others were stopped. Its error is above."
        )


def join(ranks: int) -> int:
    """Join this rank's torchrun group (NCCL on GPUs, gloo on the CPU); returns this rank's number."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.get_world_size() != ranks:
        raise RuntimeError(f"--tp {ranks} started in a group of {dist.get_world_size()} processes")
    return dist.get_rank()


def shared_seed(seed: int | None) -> int:
    """``seed``, or one drawn by rank 0, the same on every rank: sampling then picks the same token everywhere."""
    chosen = [seed if seed is not None else random.randrange(2**31)]
    dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
