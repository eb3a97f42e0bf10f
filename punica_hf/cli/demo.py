"""``punica-hf demo``: one mixed batch on the packaged demo model, each row with its own adapter."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .. import demo, ops
from ..model import MultiLoraModel
from .common import (
    BASE, DEMO_MODEL, add_device_arguments, demo_adapter_sources, load_demo_model, resolve_device, resolve_dtype,
)


def register(command: Callable[..., argparse.ArgumentParser]) -> None:
    """Add this module's subcommand(s) through ``command(name, run, summary, description, epilog)``."""
    demo_parser = command(
        "demo", run,
        "run one mixed batch on the packaged demo model and its adapters",
        "Loads the tiny demo model and its task adapters, runs ONE batch where every row uses another adapter "
        "(or the base model), and prints each row's prompt, adapter and answer.",
        "  punica-hf demo\n  punica-hf demo --device cpu",
    )
    add_device_arguments(demo_parser)


def run(args: argparse.Namespace, console: Console) -> None:
    adapter_sources = demo_adapter_sources()
    device = resolve_device(args.device)
    with console.status(f"loading the demo model and {len(adapter_sources)} adapters on {device}"):
        base = load_demo_model(device, resolve_dtype(args.dtype, device, DEMO_MODEL))
        model = MultiLoraModel(base, max_adapters=len(adapter_sources))
        model.load_adapters(adapter_sources)
    # one row per task, each on another example word, and a base-model row that copies its word
    rows = [(task, spec.examples[i % len(spec.examples)]) for i, (task, spec) in enumerate(demo.TASKS.items())]
    rows.append((None, next(iter(demo.TASKS.values())).examples[0]))

    with console.status(f"running one batch of {len(rows)} rows"):
        start = time.perf_counter()
        answers = demo.generate_answers(model, [word for _, word in rows], adapter_ids=[task for task, _ in rows])
        seconds = time.perf_counter() - start

    table = Table(
        title="punica-hf demo: one batch, one adapter per row",
        caption=f"{len(rows)} rows in {seconds:.2f} s on {device} (LoRA ops: {ops.backend_for(device, ops.requested_backend())})",
    )
    for column in ("prompt", "adapter", "task", "answer", "expected"):
        table.add_column(column)
    for (task, word), answer in zip(rows, answers):
        expected = demo.TASKS[task].answer(word) if task else word
        description = demo.TASKS[task].description if task else "copy the word (no adapter)"
        mark = Text(" ✓", style="green") if answer == expected else Text(" ✗", style="red")
        table.add_row(
            demo.make_prompt(word), task or BASE, description, Text(answer, style="bold"), Text(expected) + mark
        )
    console.print(table)
