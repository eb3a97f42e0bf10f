"""Watching a batch generate: a streamer that collects every row's new tokens, and rich views of them.

``BatchStreamer`` is a transformers streamer (``generate(..., streamer=...)``) that, unlike ``TextStreamer``,
takes the whole batch: each step ``generate`` hands it one new token per row. The views only read its state,
so the same streamer feeds a compact table (``generate``) or a panel per request (``dashboard``), inside a
``rich.live.Live`` that repaints them while the batch runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
from rich.columns import Columns
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from transformers.generation.streamers import BaseStreamer


@dataclass(frozen=True)
class Request:
    """One row of the batch: its prompt text and its adapter name (None = the base model)."""

    prompt: str
    adapter: str | None

    @property
    def adapter_label(self) -> str:
        return self.adapter or "base"


class BatchStreamer(BaseStreamer):
    """Each row's generated tokens so far, and when each row started and finished.

    ``generate`` calls ``put`` first with the prompts ``[B, T]``, then once per decoding step with the new token
    of every row ``[B]`` (rows that already finished get padding), and ``end`` after the last step. A row is
    finished at its first token in ``eos_token_ids``; that token and everything after it are not kept.
    ``on_update`` is called after every step and at the end.
    """

    def __init__(
        self,
        num_rows: int,
        eos_token_ids: Collection[int],
        on_update: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(num_rows)]
        self.finished_at: list[float | None] = [None] * num_rows
        self.started_at: float | None = None
        self.steps = 0
        self.eos_token_ids = frozenset(eos_token_ids)
        self.on_update = on_update
        self._clock = clock

    def put(self, value: torch.Tensor) -> None:
        if self.started_at is None:  # the prompts: generation starts now, prefill included in every rate
            self.started_at = self._clock()
            return
        now = self._clock()
        for row, token in enumerate(value.reshape(-1).tolist()):
            if self.finished_at[row] is not None:
                continue
            if token in self.eos_token_ids:
                self.finished_at[row] = now
            else:
                self.tokens[row].append(token)
        self.steps += 1
        self._notify()

    def end(self) -> None:
        now = self._clock()
        self.finished_at = [now if finished is None else finished for finished in self.finished_at]
        self._notify()

    @property
    def done(self) -> bool:
        return all(finished is not None for finished in self.finished_at)

    def elapsed(self, row: int | None = None) -> float:
        """Seconds since generation started, up to the row's finish (or the last row's, for ``row=None``)."""
        if self.started_at is None:
            return 0.0
        if row is None:
            end = max(self.finished_at) if self.done else self._clock()
        else:
            finished = self.finished_at[row]
            end = self._clock() if finished is None else finished
        return max(end - self.started_at, 1e-9)

    def tokens_per_second(self, row: int | None = None) -> float:
        """Generated tokens per second of one row, or of the whole batch for ``row=None``."""
        count = sum(map(len, self.tokens)) if row is None else len(self.tokens[row])
        return count / self.elapsed(row) if self.started_at is not None else 0.0

    def _notify(self) -> None:
        if self.on_update is not None:
            self.on_update()


class BatchView:
    """Renders a ``BatchStreamer``'s state for ``rich.live.Live``: ``table()`` or ``panels()``."""

    def __init__(self, requests: Sequence[Request], streamer: BatchStreamer, decode: Callable[[list[int]], str]):
        self.requests = requests
        self.streamer = streamer
        self.decode = decode

    def table(self) -> RenderableType:
        """One line per request: adapter, prompt, the answer so far, tokens and tokens/s."""
        table = Table(title="punica-hf: one batch, one adapter per row", caption=self._summary(), expand=True)
        table.add_column("#", justify="right", style="dim")
        table.add_column("adapter", style="cyan", no_wrap=True)
        table.add_column("prompt", ratio=2)
        table.add_column("answer", style="bold", ratio=3)
        table.add_column("tokens", justify="right")
        table.add_column("tok/s", justify="right")
        for row, request in enumerate(self.requests):
            table.add_row(
                str(row),
                Text(request.adapter_label),
                Text(request.prompt),
                self._answer(row),
                str(len(self.streamer.tokens[row])),
                f"{self.streamer.tokens_per_second(row):.1f}",
            )
        return table

    def panels(self) -> RenderableType:
        """A panel per request, side by side, with its status and tokens/s, above a line for the whole batch."""
        panels = []
        for row, request in enumerate(self.requests):
            body = Text(request.prompt, style="dim")
            body.append("\n→ ")
            body.append_text(self._answer(row))
            tokens, rate = len(self.streamer.tokens[row]), self.streamer.tokens_per_second(row)
            panels.append(
                Panel(
                    body,
                    title=Text.assemble(f"#{row} ", (request.adapter_label, "cyan")),
                    subtitle=f"{tokens} tok · {rate:.1f} tok/s",
                    border_style="yellow" if self.streamer.finished_at[row] is None else "green",
                    width=36,
                )
            )
        return Group(Text("punica-hf dashboard", style="bold"), Columns(panels), Text(self._summary()))

    def _answer(self, row: int) -> Text:
        answer = Text(self.decode(self.streamer.tokens[row]), style="bold")
        if self.streamer.finished_at[row] is None:
            answer.append("▌", style="blink")
        return answer

    def _summary(self) -> str:
        streamer = self.streamer
        finished = sum(finished is not None for finished in streamer.finished_at)
        return (
            f"{finished}/{len(self.requests)} rows done · {streamer.steps} steps · "
            f"{sum(map(len, streamer.tokens))} tokens in {streamer.elapsed():.2f} s · "
            f"{streamer.tokens_per_second():.1f} tok/s overall"
        )
