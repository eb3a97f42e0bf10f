"""The engine's loop over a model split by tensor parallelism (``model.tensor_parallel``): a mixin of ``Engine``.

Every rank runs the same steps. Rank 0 decides each pass (admissions with their adapter slot and seed,
cancellations, stop) and sends it as a ``tp_control.StepControl``; the other ranks apply it in the same order,
pin each adapter in rank 0's slot (or stop every rank, saying why), and take rank 0's sampled tokens, so their
batches never drift apart. Idle, rank 0 sends a heartbeat at least every ``tp_control.HEARTBEAT_SECONDS``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from . import tp_control
from .handles import RequestHandle
from .request_state import RequestState

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
                record = control.share(tp_control.StepControl(
                    admissions=tuple(
                        tp_control.Admission(r.request_id, r.handle.prompt_token_ids, r.handle.adapter, r.params,
                                             r.slot)
                        for r in admitted
                    ),
                    cancellations=tuple(r.request_id for r in cancelled),
                    stop=self._stop and not self._requests,
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
            if record.stop:
                return
            if self._run_pass(started, cancelled) or not control.leader:
                continue
            idle_wait = IDLE_POLL_SECONDS if self._queue else tp_control.HEARTBEAT_SECONDS
            self._wake.wait(idle_wait)
            self._wake.clear()

    def _follow_admissions(self, admissions: Sequence[tp_control.Admission]) -> None:
        """A follower schedules what rank 0 admitted, in its order, each adapter pinned in rank 0's slot."""
        for admission in admissions:
            request = RequestState.create(
                RequestHandle(self._cancel, admission.request_id, admission.adapter, admission.prompt_token_ids),
                admission.params, self.eos_token_ids, None if self.tokenizer is None else self.tokenizer.decode,
                self.hf_model.device,
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

    def _agree_on_samples(self, row_requests: list[RequestState | None], failures: list, tokens: list
                          ) -> tuple[list[tuple[RequestState, str]], list[tuple[int, int]]]:
        """Every rank takes rank 0's failures and sampled tokens, so the ranks' batches never drift apart (their
        scores may differ in the last bits where the split sums run in another order)."""
        if self._control.leader:
            row_of = {id(request): row for row, request in enumerate(row_requests)}
            samples = self._control.share(tp_control.StepSamples(
                failures=tuple((row_of[id(request)], reason) for request, reason in failures),
                tokens=tuple((row, int(token)) for row, token in tokens),
            ))
        else:
            samples = self._control.share()
        failed = [(row_requests[row], reason) for row, reason in samples.failures]
        return [(request, reason) for request, reason in failed if request is not None], list(samples.tokens)
