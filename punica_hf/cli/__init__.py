"""The ``punica-hf`` command line: ``demo``, ``generate``, ``dashboard``, ``convert`` and ``serve``.

Every command runs inside ``main``, which turns any error into one line on stderr and exit code 1 (2 for a bad
command line), unless ``--debug`` asks for the traceback. ``generate`` and ``dashboard`` build one batch whose
rows each name their adapter (or the base model) and stream it through a ``BatchStreamer`` into a live view.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from rich.console import Console

from .. import __version__
from . import convert, demo, generate, serve


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_request:  # --help, --version and usage errors; the message is already printed
        return int(exit_request.code or 0)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for commands that start copies of themselves (--tp)
    console, errors = Console(), Console(stderr=True)
    try:
        args.run(args, console)
    except KeyboardInterrupt:
        errors.print("interrupted", style="red")
        return 130
    except Exception as error:
        if args.debug:
            raise
        errors.print(f"error: {_one_line(error)}", style="red", markup=False, highlight=False, soft_wrap=True)
        return 1
    return 0


def _one_line(error: Exception) -> str:
    message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    message = " ".join(str(message).split()) or type(error).__name__
    return f"{message} (run with --debug for the traceback)"


# ------------------------------------------------------------------------------------------------ parser
class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (the full usage is a ``--help`` away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the line breaks of descriptions and example epilogs."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="punica-hf",
        description="Serve many LoRA adapters in one batch on one Hugging Face model: every row of a batch "
        "can use its own adapter (or none).",
        epilog="examples:\n"
        "  punica-hf demo\n"
        "  punica-hf generate --model demo --prompt reverse:lora --prompt base:lora\n"
        "  punica-hf dashboard\n"
        "  punica-hf convert ./my-peft-adapter my-adapter.safetensors\n\n"
        "Run `punica-hf COMMAND --help` for the options of each command.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"punica-hf {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    # --debug is accepted after the command too; SUPPRESS keeps a subcommand from resetting the global value
    debug_anywhere = argparse.ArgumentParser(add_help=False)
    debug_anywhere.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the full traceback of an error"
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    def command(name: str, run: Callable, summary: str, description: str, epilog: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name, help=summary, description=f"{summary}. {description}", epilog=f"examples:\n{epilog}",
            parents=[debug_anywhere], formatter_class=_HelpFormatter,
        )
        sub.set_defaults(run=run)
        return sub

    demo.register(command)
    generate.register(command)
    convert.register(command)
    serve.register(command)
    return parser
