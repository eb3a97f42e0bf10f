"""A submitted request as its caller sees it: streamed pieces (from threads or asyncio) and the final completion."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator

from .types import Completion, Delta


class RequestHandle:
    """A submitted request: iterate it (``for delta in handle`` / ``async for``) to stream its pieces, or wait for
    the ``Completion`` with ``result()`` / ``await aresult()``; ``cancel()`` stops it and frees its KV memory."""

    def __init__(self, cancel: Callable[[RequestHandle], None], request_id: str, adapter: str | None,
                 prompt_token_ids: tuple[int, ...]):
        self.request_id = request_id
        self.adapter = adapter
        self.prompt_token_ids = prompt_token_ids
        self._cancel_request = cancel  # the engine's: stops this handle's request at its next step
        self._deltas: list[Delta] = []
        self._completion: Completion | None = None
        self._condition = threading.Condition()
        self._async_wakers: list[tuple[_LoopWakeups, asyncio.Event]] = []

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
            self._cancel_request(self)

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
        waker = (_wakeups_of(asyncio.get_running_loop()), asyncio.Event())
        woken = waker[1]
        with self._condition:
            self._async_wakers.append(waker)
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
                self._async_wakers.remove(waker)

    # -------------------------------------------------------------- engine side
    def _publish(self, delta: Delta | None, completion: Completion | None = None) -> None:
        with self._condition:
            if delta is not None:
                self._deltas.append(delta)
            if completion is not None:
                self._completion = completion
            self._condition.notify_all()
            wakers = list(self._async_wakers)
        for wakeups, woken in wakers:
            wakeups.set(woken)


class _LoopWakeups:
    """Sets asyncio events of one event loop from other threads, waking the loop once for all the events set since
    it last ran them: a step that gives 128 streamed requests a token costs one ``call_soon_threadsafe`` (a write
    to the loop's wake-up socket) in the engine's thread, not 128."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the registry's value must not keep its key (the loop) alive
        self._lock = threading.Lock()
        self._events: list[asyncio.Event] = []

    def set(self, event: asyncio.Event) -> None:
        with self._lock:
            wake = not self._events  # else a wake-up is on its way, and will set this one too
            self._events.append(event)
        if wake:
            loop = self._loop()
            try:
                if loop is None:
                    raise RuntimeError("the event loop is gone")
                loop.call_soon_threadsafe(self._set_all)
            except RuntimeError:  # the event loop is closed: nobody is waiting there any more
                with self._lock:
                    self._events.clear()

    def _set_all(self) -> None:
        with self._lock:
            events, self._events = self._events, []
        for event in events:
            event.set()


_loop_wakeups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its _LoopWakeups
_loop_wakeups_lock = threading.Lock()


def _wakeups_of(loop: asyncio.AbstractEventLoop) -> _LoopWakeups:
    with _loop_wakeups_lock:
        wakeups = _loop_wakeups.get(loop)
        if wakeups is None:
            wakeups = _loop_wakeups[loop] = _LoopWakeups(loop)
        return wakeups

