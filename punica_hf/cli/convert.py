"""``punica-hf convert``: PEFT adapters into punica_hf's fast-loading serving format."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from rich import filesize
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ..formats import DTYPES, SUFFIX, adapter_name, convert_adapter


def register(command: Callable[..., argparse.ArgumentParser]) -> None:
    """Add this module's subcommand(s) through ``command(name, run, summary, description, epilog)``."""
    convert_parser = command(
        "convert", run,
        "convert PEFT adapters into punica_hf's fast-loading serving format",
        "Reads PEFT LoRA adapters (folders, Hub repo ids or converted files) and writes one .safetensors file "
        "per adapter with the scaling folded in, loadable by MultiLoraModel.load_adapters and "
        "--adapter NAME=FILE.safetensors.",
        "  punica-hf convert ./my-peft-adapter my-adapter.safetensors\n"
        "  punica-hf convert ./adapters/* converted/            # one converted/<name>.safetensors each\n"
        "  punica-hf convert org/some-lora converted/ --dtype bf16 --revision main",
    )
    convert_parser.add_argument(
        "sources", nargs="+", metavar="SRC",
        help="a PEFT adapter folder, a Hub repo id, or a converted .safetensors file (to change its dtype)",
    )
    convert_parser.add_argument(
        "destination", metavar="DST",
        help="with one SRC: the output file (if it ends in .safetensors) or a folder; with several: a folder "
        "that receives <name>.safetensors per source (created if missing)",
    )
    convert_parser.add_argument(
        "--dtype", choices=list(DTYPES), default="fp32",
        help="dtype of the stored factors: fp32 (default) gives outputs identical to the PEFT adapter, bf16 and "
        "fp16 halve the file",
    )
    convert_parser.add_argument(
        "--base-model", metavar="NAME",
        help="base model recorded in the file (default: base_model_name_or_path of the adapter config)",
    )
    convert_parser.add_argument(
        "--overwrite", action="store_true", help="replace output files that exist (refused without it)",
    )
    convert_parser.add_argument("--revision", help="Hub revision (branch, tag or commit) of Hub sources")
    convert_parser.add_argument("--subfolder", help="folder inside each source (Hub repo or local folder)")
    convert_parser.add_argument("--cache-dir", metavar="DIR", help="Hugging Face cache folder for Hub sources")


def run(args: argparse.Namespace, console: Console) -> None:
    """All or nothing: every source is converted into a hidden folder beside the outputs first; the files go to
    their places only once every one is written (a bad source, or an interrupt, leaves no output behind)."""
    destination = Path(args.destination)
    if len(args.sources) > 1 and destination.suffix == SUFFIX:
        raise ValueError(f"{len(args.sources)} sources need a folder as DST, not the file {destination}")
    if destination.suffix == SUFFIX:  # the file named
        outputs = [destination]
    else:  # a folder: a file per source, named after it
        names = [adapter_name(source) for source in args.sources]
        clashes = sorted({name for name in names if names.count(name) > 1})
        if clashes:
            raise ValueError(f"several sources would be written to the same file name: {', '.join(clashes)}")
        outputs = [destination / f"{name}{SUFFIX}" for name in names]
    _check_outputs(outputs, args.overwrite)
    options = dict(
        dtype=DTYPES[args.dtype], base_model=args.base_model,
        revision=args.revision, subfolder=args.subfolder, cache_dir=args.cache_dir,
    )
    folder = outputs[0].parent
    made = [parent for parent in [folder, *folder.parents] if not parent.exists()]  # deepest first
    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".punica-hf-convert-", dir=folder))
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    )
    try:
        with progress:
            bar = progress.add_task("converting", total=len(args.sources))
            staged = []
            for number, (source, output) in enumerate(zip(args.sources, outputs)):
                progress.update(bar, description=f"converting {output.stem}")
                staged.append(convert_adapter(source, staging / f"{number}{SUFFIX}", **options))
                progress.advance(bar)
            progress.update(bar, description="converted")
        _check_outputs(outputs, args.overwrite)  # again: the conversions took time
        for staged_file, output in zip(staged, outputs):
            os.replace(staged_file, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        for parent in made:  # the folders this call made, left empty by a failure
            if parent.exists() and not any(parent.iterdir()):
                parent.rmdir()
    written = list(zip(args.sources, outputs))

    table = Table(title=f"converted {len(written)} adapter(s) ({args.dtype})")
    for column in ("source", "file", "size"):
        table.add_column(column)
    for source, path in written:
        table.add_row(Text(str(source)), Text(str(path)), filesize.decimal(path.stat().st_size))
    console.print(table)


def _check_outputs(outputs: list[Path], overwrite: bool) -> None:
    existing = [str(output) for output in outputs if output.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{', '.join(existing)} exist(s): remove them, or pass --overwrite to replace them")
    directories = [str(output) for output in outputs if output.is_dir()]
    if directories:
        raise IsADirectoryError(f"{', '.join(directories)}: a folder where the converted file would go")
