"""The engine's loop over a model split by tensor parallelism (``model.tensor_parallel``): a mixin of ``Engine``.

Every rank runs the same steps. Rank 0 decides each pass (admissions with their adapter slot and seed,
cancellations, adapter loads and unloads, stop) and sends it as a ``tp_control.StepControl``; the other ranks apply
it in the same order, pin each adapter in rank 0's slot (or stop every rank, saying why), and take rank 0's sampled
tokens, so their batches never drift apart. Idle, rank 0 sends a heartbeat at least every
``tp_control.HEARTBEAT_SECONDS``.

A runtime adapter load or unload asked on rank 0 (``Engine.load_adapters`` / ``unload_adapter``, from any thread)
waits for the engine thread's next pass: every rank applies it after that pass's admissions (so no request admitted
before it can depend on it), then all ranks agree on its outcome before the next pass may admit a request using it.
A load that failed on any rank is undone on the ranks where it succeeded, and rank 0's caller gets the error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError

import torch

from . import tp_control
from .handles import RequestHandle
from .request_state import RequestState
from .sampling import SampledStep
from .types import EngineClosedError

logger = logging.getLogger(__name__)
IDLE_POLL_SECONDS = 0.002  # how often a request waiting for its adapter to load retries


class TensorParallelLoop:
    """``Engine``'s methods for a split model; they use the engine's own state (``self._control``, the queue, the
    requests, the backend) and its single-process steps (``_admit``, ``_run_pass``, ...)."""

    def _tensor_parallel_loop(self) -> None:
        """Every rank's loop over a split model: rank 0 decides and sends each pass's ``StepControl``, every rank
        applies it, then all run the same step. Idle, rank 0 sends a heartbeat at least every
        ``tp_control.HEARTBEAT_SECONDS``, and a stop record once shutting down with no request left."""
        control = self._control
        while True:
            started = time.perf_counter()
            if control.leader:
                admitted = self._admit()
                cancelled = self._send_cancellations()
                with self._lock:
                    changes, self._adapter_changes = self._adapter_changes, []
                    self._changes_sent = changes
                record = control.share(tp_control.StepControl(
                    admissions=tuple(
                        tp_control.Admission(r.request_id, r.handle.prompt_token_ids, r.handle.adapter, r.params,
                                             r.slot, r.prefix_key)
                        for r in admitted
                    ),
                    cancellations=tuple(r.request_id for r in cancelled),
                    adapter_changes=tuple(change for change, _ in changes),
                    stop=self._finished_stopping(),
                ))
            else:
                record = control.share()
                problem = None
                try:
                    self._follow_admissions(record.admissions)
                except Exception as error:  # every rank stops, rather than run steps the others do not
                    problem = f"rank {control.rank}: {error}"
                cancelled = self._follow_cancellations(record.cancellations)
            if record.admissions:
                control.check_agreement(None if control.leader else problem)
            if record.adapter_changes:
                self._apply_adapter_changes(record.adapter_changes, [done for _, done in changes] if control.leader
                                            else None)
            if record.stop:
                return
            if self._run_pass(started, cancelled) or not control.leader:
                continue
            idle_wait = IDLE_POLL_SECONDS if self._queue else tp_control.HEARTBEAT_SECONDS
            self._wake.wait(idle_wait)
            self._wake.clear()

    def _ask_adapter_change(self, change: tp_control.AdapterChange):
        """Rank 0: have every rank apply ``change`` at the engine thread's next pass; returns rank 0's outcome once
        all ranks agree, or raises the error (rank 0's own, or a ValueError naming the ranks that failed)."""
        if not self._control.leader:
            raise RuntimeError(f"change adapters on rank 0 only: rank {self._control.rank} follows rank 0's changes")
        done = Future()
        with self._lock:
            if self._adapter_changes is None or not self.running:
                raise EngineClosedError("under tensor parallelism adapters change through a running engine (rank 0 "
                                        "sends the change to every rank); the engine is not running")
            self._adapter_changes.append((change, done))
        self._wake.set()
        return done.result()

    def _apply_adapter_changes(self, changes: Sequence[tp_control.AdapterChange], waiting: list[Future] | None
                               ) -> None:
        """Every rank applies each change and agrees on its outcome: a load that failed anywhere is undone where
        it succeeded (all or nothing); rank 0 answers its callers (``waiting``). An unload done on some ranks only
        cannot be undone: every rank stops (``RanksDiffer``)."""
        control = self._control
        for index, change in enumerate(changes):
            outcome, error = None, None
            try:
                if change.unload is not None:
                    self.model.unload_adapter(change.unload)
                else:
                    outcome = self.model.load_adapters(dict(change.load))
            except Exception as raised:
                error = raised
            problems = [p for p in control.gather(None if error is None else f"rank {control.rank}: {error}")
                        if p is not None]
            if problems and change.unload is not None and len(problems) < control.world_size:
                raise tp_control.RanksDiffer(f"unloading {change.unload!r} failed on some ranks only: "
                                             + "; ".join(problems))
            if problems and error is None:  # loaded here, not on another rank: undone, so the ranks agree
                for name, _ in change.load:
                    self.model.unload_adapter(name)
            if waiting is not None:  # rank 0's own error keeps its type (the server's answer depends on it)
                _answer(waiting[index], outcome, (error or ValueError("; ".join(problems))) if problems else None)

    def _fail_adapter_changes(self, message: str, close: bool) -> None:
        """Fail every adapter change asked and not answered yet (queued, or sent to the ranks); ``close``: the loop
        has ended, refuse further ones."""
        with self._lock:
            unanswered = [*(self._adapter_changes or ()), *self._changes_sent]
            self._adapter_changes = None if close else []
            self._changes_sent = []
        for _, done in unanswered:
            _answer(done, None, EngineClosedError(message))

    def _tensor_parallel_failure(self, error: BaseException) -> BaseException:
        """The error this rank's engine stops with: another rank's reported failure when there is one (this rank's
        error then follows from it: that rank left the collectives), else this rank's own, named with its rank and
        reported to the others. Ranks that differ all stop at once (``RanksDiffer``): nothing to report."""
        control = self._control
        if isinstance(error, tp_control.RanksDiffer):
            return error
        report = control.failure_report()
        if report is not None:
            return tp_control.RankFailed(report)
        if not isinstance(error, tp_control.RankFailed):
            error = tp_control.RankFailed(f"rank {control.rank}: {type(error).__name__}: {error}")
        control.report_failure(str(error))
        return error

    def _after_tensor_parallel_failure(self, error: BaseException) -> None:
        """This rank's own failure, its requests failed: rank 0 stops the followers that wait for its next record
        (after a failed step they may wait in its collectives instead, until rank 0's process leaves the group); a
        follower waits for rank 0 to have failed its requests before its process may leave the group."""
        control = self._control
        if not control.reported:
            return
        if not control.leader:
            control.wait_for_acknowledgement()
        elif not isinstance(error, tp_control.StepFailed):
            control.stop_followers()

    def _watch_other_ranks(self) -> None:
        """Rank 0, beside the engine thread while it runs: a follower's reported failure fails every request and
        pending adapter change at once, while the engine thread may still wait in a collective the failed rank
        never joins (it ends once that rank leaves the group)."""
        control = self._control
        while self._thread.is_alive():
            report = control.failure_report()
            if report is not None and not control.reported:
                with self._lock:  # submit() refuses from now on: every request it accepted is failed below
                    self._error = tp_control.RankFailed(report)
                    self._accepting = False
                logger.error("the engine stopped: %s", report)
                self._fail_unfinished(f"the engine stopped: {report}", release=False)
                self._fail_adapter_changes(f"the engine stopped: {report}", close=False)
                control.acknowledge_failure()
                return
            self._thread.join(tp_control.FAILURE_POLL_SECONDS)

    def _follow_admissions(self, admissions: Sequence[tp_control.Admission]) -> None:
        """A follower schedules what rank 0 admitted, in its order, each adapter pinned in rank 0's slot."""
        for admission in admissions:
            request = RequestState.create(
                RequestHandle(self._cancel, admission.request_id, admission.adapter, admission.prompt_token_ids),
                admission.params, self.eos_token_ids, None if self.tokenizer is None else self.tokenizer.decode,
            )
            if admission.adapter is not None:
                # Rank 0 placed it, so it is loaded here too (unless the ranks' adapters differ): wait for its read.
                request.lease = self.model.acquire([admission.adapter])
                request.slot = request.lease.slots[0]
                if request.slot != admission.slot:
                    request.lease.release()
                    raise RuntimeError(
                        f"adapter {admission.adapter!r} is in slot {request.slot} here and in slot {admission.slot} "
                        "on rank 0: load and unload the same adapters on every rank, in the same order"
                    )
            request.prefix_key = admission.prefix_key
            with self._lock:
                self._requests[request.request_id] = request
            self._hand_to_backend(request)

    def _follow_cancellations(self, request_ids: Sequence[str]) -> list[RequestState]:
        """A follower cancels what rank 0 cancelled, and nothing else (its own stop-string and NaN checks see the
        same tokens and ended the same requests on rank 0, which sent them here)."""
        with self._lock:
            self._cancels.clear()
        handed_over = [self._requests[request_id] for request_id in request_ids if request_id in self._requests]
        for request in handed_over:
            self._backend.cancel(request.request_id)
        return handed_over

    def _agree_on_samples(self, sampled: SampledStep) -> SampledStep:
        """Every rank takes rank 0's failures and sampled tokens, so the ranks' batches never drift apart (their
        scores may differ in the last bits where the split sums run in another order)."""
        if self._control.leader:
            shared = self._control.share(tp_control.StepSamples(
                failures=tuple(sampled.failures), tokens=tuple(zip(sampled.rows, sampled.tokens.tolist())),
            ))
        else:
            shared = self._control.share()
        tokens = torch.tensor([token for _, token in shared.tokens], dtype=torch.long, device=sampled.tokens.device)
        return SampledStep(list(shared.failures), [row for row, _ in shared.tokens], tokens)


def _answer(done: Future, result, error: BaseException | None) -> None:
    """Give an adapter change's caller its outcome, unless it has one already (the engine stopped meanwhile)."""
    try:
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)
    except InvalidStateError:
        pass
