"""The engine over a tensor-parallel model: rank 0 decides, every rank runs the same batch.

Every rank runs the engine's step loop, and every step's forward holds collectives over the ranks, so every rank
must schedule the same requests in the same order and cancel the same ones at the same step. Rank 0 alone takes
requests; at the start of each loop pass it sends one ``StepControl`` (what it admitted, with each adapter's slot
and the request's settings, seed included; what it cancelled; the adapter loads and unloads asked of it; whether to
stop) and the other ranks (followers) do exactly that. Every rank applies an adapter change at the same point of the
pass, then all agree on its outcome (``gather``): a load that failed on any rank is undone on every rank. While idle rank 0 still sends an empty record every ``HEARTBEAT_SECONDS``, so a follower never
waits in a collective for longer than that; at shutdown it sends a stop record once every request has finished.

The records travel over a gloo group of their own: small Python objects, whatever backend the model runs on.

A rank whose engine fails (a step that raises on it alone, say) cannot tell the others through a collective: they
may be waiting in one of the model's, which it will never join. It writes its error to torch.distributed's key-value
store instead (``report_failure``), where rank 0 looks every ``FAILURE_POLL_SECONDS`` and fails every request with
it at once; the failed rank then waits (at most ``FAILURE_ACK_SECONDS``) for rank 0 to have done so before its
process leaves the group, which ends the others' collectives with an error (gloo), or torchrun stops them.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ..torch_compat import process_group_store
from .types import SamplingParams

logger = logging.getLogger(__name__)
HEARTBEAT_SECONDS = 0.5  # the longest rank 0 stays silent while idle: a follower's longest wait in a broadcast
# A follower that hears nothing this long gives up (its engine stops with an error) rather than wait forever for a
# rank 0 that hangs: far above any one step, CUDA graph captures included.
CONTROL_TIMEOUT = timedelta(minutes=5)
FAILURE_POLL_SECONDS = 0.1  # how often rank 0 looks for another rank's failure report
FAILURE_ACK_SECONDS = 10.0  # how long a failed follower waits for rank 0 to fail its requests before it leaves
_channel_numbers = itertools.count()  # the same on every rank: channels are made on all ranks at once


@dataclass(frozen=True)
class Admission:
    """A request rank 0 handed to transformers' scheduler; ``slot``: where rank 0 placed its adapter (-1: base)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    adapter: str | None
    params: SamplingParams  # its seed fixed by rank 0, so every rank draws the same tokens
    slot: int
    prefix_key: tuple[str, int] | None  # what rank 0 shares its KV pages under: every rank matches the same pages


@dataclass(frozen=True)
class AdapterChange:
    """A runtime adapter change asked on rank 0: register ``load`` (``{name: path}``, the same path on every rank:
    the ranks share one machine's files), or unregister the adapter ``unload``."""

    load: tuple[tuple[str, str], ...] = ()
    unload: str | None = None


@dataclass(frozen=True)
class StepControl:
    """Rank 0's decisions for one pass of the step loop, which every rank applies before ``prepare``."""

    admissions: tuple[Admission, ...] = ()
    cancellations: tuple[str, ...] = ()  # ids of requests transformers runs
    adapter_changes: tuple[AdapterChange, ...] = ()  # applied after the admissions, which never use them
    stop: bool = False


@dataclass(frozen=True)
class StepSamples:
    """Rank 0's verdict on a step's scores: the rows that fail (with why) and the sampled token of each row."""

    failures: tuple[tuple[int, str], ...]
    tokens: tuple[tuple[int, int], ...]


class RanksDiffer(RuntimeError):
    """A follower could not do what rank 0 decided (its adapters differ): every rank's engine stops with this."""


class RankFailed(RuntimeError):
    """A rank's engine failed (its message names the rank and the error): every rank's engine stops with this."""


class StepFailed(RankFailed):
    """A step failed on this rank: the other ranks ran, or wait in, that step's collectives."""


class ControlChannel:
    """Rank 0's values, broadcast to every rank of the default process group. Made on every rank at once (making
    its group is a collective)."""

    def __init__(self) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("a tensor-parallel engine needs torch.distributed initialized (as the split model does)")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.model_backend = dist.get_backend()  # what the split model's collectives run on (its groups inherit it)
        self._group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        self.received = 0  # records a follower has taken (heartbeats included)
        # Failure reports: keys of this channel's own in the group's store (read while a collective may hang).
        self._reports = dist.PrefixStore(f"punica_hf/tp_engine/{next(_channel_numbers)}/", process_group_store())
        self.reported = False  # whether this rank reported a failure of its own

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, value=None):
        """Rank 0's ``value`` on every rank (followers pass nothing); blocks until rank 0 sends it."""
        box = [value if self.leader else None]
        dist.broadcast_object_list(box, src=0, group=self._group)
        if not self.leader:
            self.received += 1
        return box[0]

    def check_agreement(self, problem: str | None) -> None:
        """Every rank says whether it could follow this pass's admissions (``problem``: why not); ``RanksDiffer``
        on every rank if one could not. Once per pass that admits, so a diverging rank never leaves the others
        waiting in the model's collectives."""
        reported = [p for p in self.gather(problem) if p is not None]
        if reported:
            raise RanksDiffer("; ".join(reported))

    def gather(self, value) -> list:
        """Every rank's ``value``, by rank, on every rank."""
        values = [None] * self.world_size
        dist.all_gather_object(values, value, group=self._group)
        return values

    def report_failure(self, message: str) -> None:
        """Tell every rank that this rank's engine failed, and why (the first report of the group is kept)."""
        self.reported = True
        self._reports.compare_set("failure", "", message)

    def failure_report(self) -> str | None:
        """The failure a rank reported, None while none has."""
        if not self._reports.check(["failure"]):
            return None
        return self._reports.get("failure").decode()

    def acknowledge_failure(self) -> None:
        """Rank 0 has failed its requests with the reported failure."""
        self._reports.set("acknowledged", "1")

    def wait_for_acknowledgement(self) -> None:
        """A failed follower: wait (at most ``FAILURE_ACK_SECONDS``) for rank 0 to have failed its requests."""
        try:
            self._reports.wait(["acknowledged"], timedelta(seconds=FAILURE_ACK_SECONDS))
        except Exception:  # rank 0 is gone or hangs: leave anyway
            logger.warning("rank 0 did not acknowledge this rank's failure within %s s", FAILURE_ACK_SECONDS)

    def stop_followers(self) -> None:
        """Rank 0's engine thread failed: tell the followers, waiting for its next record, to stop (best effort: a
        follower that waits elsewhere fails on its own)."""
        try:
            self.share(StepControl(stop=True))
        except Exception:
            logger.exception("could not tell the other ranks to stop")
