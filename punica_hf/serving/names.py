"""The names an adapter may be served under: those of a Hugging Face Hub repo id (``org/name`` or ``name``).

They travel in URLs, logs, metrics labels and the OpenAI ``model`` field: a bounded, printable ASCII alphabet keeps
every one of those readable and safe (no NUL, no control characters, no 100 KB names). The HTTP server checks them
at runtime loads (``lora_name``) and ``punica-hf serve`` for ``--adapter NAME=...``.
"""

from __future__ import annotations

import re

ADAPTER_NAME_RULES = (
    "letters, digits, '-', '_' and '.', in one part or two joined by '/'; each part 1 to 96 characters, not "
    "starting or ending with '-' or '.', without '--' or '..'"
)
_NAME_PART = re.compile(r"(?![-.])(?!.*(?:--|\.\.))[A-Za-z0-9_.-]{1,96}(?<![-.])", re.ASCII)


SHOWN_CHARACTERS = 100  # of a client's name in a message: a 4 MB name is not sent back whole


def shortened(text: str) -> str:
    """``text`` as a message shows it: its first ``SHOWN_CHARACTERS`` characters, "..." where it had more."""
    return text if len(text) <= SHOWN_CHARACTERS else text[:SHOWN_CHARACTERS] + "..."


def check_adapter_name(name: str) -> str:
    """``name`` if it is an allowed adapter name (``ADAPTER_NAME_RULES``), else ``ValueError`` saying why."""
    parts = name.split("/") if isinstance(name, str) else []
    if not 1 <= len(parts) <= 2 or not all(_NAME_PART.fullmatch(part) for part in parts):
        shown = repr(shortened(name) if isinstance(name, str) else name)
        raise ValueError(f"the adapter name {shown} is not allowed: use {ADAPTER_NAME_RULES}")
    return name
