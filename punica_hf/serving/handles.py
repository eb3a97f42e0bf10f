"""A submitted request as its caller sees it: streamed pieces (from threads or asyncio) and the final completion."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator

from .types import Completion, Delta


class RequestHandle:
    """A submitted request: iterate it (``for delta in handle`` / ``async for``) to stream its pieces, or wait for
    the ``Completion`` with ``result()`` / ``await aresult()``; ``cancel()`` stops it and frees its KV memory."""

    def __init__(self, cancel: Callable[[str], None], request_id: str, adapter: str | None,
                 prompt_token_ids: tuple[int, ...]):
        self.request_id = request_id
        self.adapter = adapter
        self.prompt_token_ids = prompt_token_ids
        self._cancel_request = cancel  # the engine's: stops the request at its next step
        self._deltas: list[Delta] = []
        self._completion: Completion | None = None
        self._condition = threading.Condition()
        self._async_wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    @property
    def done(self) -> bool:
        return self._completion is not None

    @property
    def started(self) -> bool:
        """Whether the request has produced output (a token, or its end): False while it waits for its turn."""
        return bool(self._deltas) or self._completion is not None

    def cancel(self) -> None:
        """Stop generating (no-op once finished); the request finishes with reason ``"cancelled"``."""
        if not self.done:
            self._cancel_request(self.request_id)

    def result(self, timeout: float | None = None) -> Completion:
        with self._condition:
            if not self._condition.wait_for(lambda: self._completion is not None, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
            return self._completion

    async def aresult(self) -> Completion:
        async for _ in self:
            pass
        return self._completion

    def __iter__(self) -> Iterator[Delta]:
        index = 0
        while True:
            with self._condition:
                self._condition.wait_for(lambda: index < len(self._deltas) or self._completion is not None)
                pending, finished = self._deltas[index:], self._completion is not None
            yield from pending
            index += len(pending)
            if finished and index == len(self._deltas):
                return

    async def __aiter__(self) -> AsyncIterator[Delta]:
        loop, woken = asyncio.get_running_loop(), asyncio.Event()
        with self._condition:
            self._async_wakers.append((loop, woken))
        try:
            index = 0
            while True:
                woken.clear()  # before reading: a delta published after this read sets it again
                with self._condition:
                    pending, finished = self._deltas[index:], self._completion is not None
                for delta in pending:
                    yield delta
                index += len(pending)
                if finished and index == len(self._deltas):
                    return
                if not pending:
                    await woken.wait()
        finally:
            with self._condition:
                self._async_wakers.remove((loop, woken))

    # -------------------------------------------------------------- engine side
    def _publish(self, delta: Delta | None, completion: Completion | None = None) -> None:
        with self._condition:
            if delta is not None:
                self._deltas.append(delta)
            if completion is not None:
                self._completion = completion
            self._condition.notify_all()
            wakers = list(self._async_wakers)
        for loop, woken in wakers:
            try:
                loop.call_soon_threadsafe(woken.set)
            except RuntimeError:  # that consumer's event loop is closed: nobody is waiting there any more
                pass

