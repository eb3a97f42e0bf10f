"""Replicas of the engine on Ray Serve, each request routed to a replica that holds its adapter (``ray`` extra).

``build_app`` returns a Ray Serve application of three deployments:

- ``EngineReplica`` (N of them): an ``Engine`` over a ``MultiLoraModel`` with the very server of ``create_app``,
  called as an ASGI app: every route, error, limit and the API key behave as in ``punica-hf serve``. Each
  response names its replica in the ``x-punica-replica`` header.
- ``Router`` (the HTTP ingress, one): reads the request's ``model`` and hands the request to a replica through
  Ray Serve's model multiplexing (``multiplexed_model_id`` = the adapter), which prefers a replica that already
  holds the adapter, and among those the least loaded; requests for the base model go to the least loaded
  replica. It streams the replica's answer back as it comes.
- ``AdapterCatalog`` (one): the runtime loads and unloads, numbered. A replica that accepts a load or unload
  records it there; every request carries the catalog's number, and a replica behind it catches up (loads or
  unloads through its own engine) before it serves the request: a runtime load reaches every replica, including
  one restarted after a failure. The catalog is the arbiter of names: a change of a name that another replica
  changed since this one caught up is refused (409) and undone here, so two replicas never hold different adapters
  under one name. A change a replica cannot make while catching up (a file gone since) is logged and skipped:
  that replica answers 404 for the adapter, the others serve it. The catalog lives in its actor's memory: if it
  dies, Ray Serve starts an empty one (a new epoch), and replicas started after that do not get the earlier loads.

A replica that dies is restarted by Ray Serve. A request it was serving is sent again (to the replica Ray Serve
picks then) if nothing of its answer was sent yet; otherwise the answer ends early: a stream with an error event
(code ``replica_lost``) and ``data: [DONE]``, any other answer by the connection's close. A replica that cannot run a
step (its engine stopped, or it lost one of its ranks) answers every request at once with a 503 that says so, and
the ingress sends such a request again too, until Ray Serve has replaced that replica. After ``RETRY_SECONDS`` of
such answers the client gets the 503.

With ``tp`` > 1 a replica is one tensor-parallel group of ``tp`` ranks on one machine (``FollowerRanks``): rank 0
in the replica's process, with the engine and the server as above; ranks 1.. in child processes the replica starts,
which run the steps rank 0 decides. A rank that stops makes the replica unhealthy, and Ray Serve replaces the
whole group; the children never outlive the replica's process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path

from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import DeploymentUnavailableError

from .app import OPEN_PATHS, APIError, BodySizeLimit, KeyRequired, RequestLimits, create_app
from .engine import Engine
from .follower_ranks import FollowerRanks
from .protocol import STREAM_END, ErrorDetail, ErrorResponse, stream_event
from .types import check_seconds

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-punica-replica"
ADAPTER_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
# A replica's engine queues and batches its requests itself: Ray Serve should not hold them back (nor send an
# adapter's requests elsewhere because its replica has "too many" in flight).
MAX_ONGOING_REQUESTS = 1024
REPLICA_LOST = (RayActorError, ActorUnavailableError)
# Marks the 503 of a replica that cannot run a step: it did nothing with the request.
LOST_REPLICA_HEADER = "x-punica-replica-lost"
# Milliseconds from a replica's taking a request to its answer's first batch (a stream's first token): what the
# request spent in the replica, apart from Ray Serve's hops before and after it.
FIRST_BATCH_HEADER = "x-punica-replica-first-ms"
# How long the ingress keeps sending a request again while replicas are lost (Ray Serve replaces one within three
# health checks), and its pause between two tries.
RETRY_SECONDS = 15.0
RETRY_PAUSE_SECONDS = 0.5
# How a streamed answer cut by its replica's death ends: an error event a client can read (OpenAI's error body, as
# the server's own streams end on a failed request), then the stream's usual end.
LOST_STREAM_END = (stream_event(ErrorResponse(error=ErrorDetail(
    message="the replica serving this request stopped mid-answer (it failed, or the server is stopping): the answer "
            "is incomplete",
    type="server_error", code="replica_lost"))) + STREAM_END).encode()
# A replica whose engine or one of its ranks has stopped answers nothing but 503s: Ray Serve replaces it after three
# failed health checks in a row, so check often (the check reads flags, and polls the ranks' processes).
HEALTH_CHECK_SECONDS = 2.0
FOLLOWER_EXIT_SECONDS = 10.0  # how long a stopping replica waits for its ranks to leave before it kills them
# Every item of a streamed answer crosses a Ray hop (replica to ingress; and to Ray Serve's proxy where clients go
# through it), each far dearer than making a token: a replica sends its answer's first token at once, then what its
# server wrote during each such interval, as one item (Ray Serve's own LLM deployments batch their streams the same
# way).
STREAM_INTERVAL_SECONDS = 0.05
# How long a stopping replica may take to answer the requests in flight before Ray Serve kills it, by default (Ray
# Serve's own default is 20 s: a queue of minutes would be cut). The ingress may take longer, by the time it sends a
# request again while replicas are lost and a margin: what a killed replica leaves unanswered, the ingress answers
# with an error (a 503; a stream: an error event).
DRAIN_SECONDS = 600.0
INGRESS_MARGIN_SECONDS = 10.0
# How long a runtime load or unload waits for the catalog to record it; beyond, the change is undone here (503).
CATALOG_SECONDS = 30.0


def build_app(
    make_engine: Callable[[], Engine],
    model_name: str,
    *,
    replicas: int = 1,
    max_adapters: int = 64,
    api_key: str | None = None,
    lora_dirs: Sequence[str | Path] | None = None,
    limits: RequestLimits | None = None,
    replica_actor_options: Mapping | None = None,
    tp: int = 1,
    follower_args: Sequence[str] = (),
    stream_interval: float = STREAM_INTERVAL_SECONDS,
    drain_seconds: float = DRAIN_SECONDS,
) -> serve.Application:
    """The Ray Serve application of ``replicas`` engines behind one OpenAI-compatible HTTP ingress.

    ``make_engine`` builds one replica's engine (not started) in the replica's process: it must pickle (a
    module-level function, or a ``functools.partial`` of one). ``max_adapters``: the adapters one replica keeps
    on its device (the model's ``max_adapters``): Ray Serve counts a replica as holding at most that many.
    ``replica_actor_options``: Ray actor options of each replica (``{"num_gpus": 1}`` on GPUs). The other
    arguments are ``create_app``'s.

    ``tp`` > 1: each replica is a tensor-parallel group of ``tp`` ranks (reserve ``tp`` GPUs per replica on GPUs:
    rank i takes the i-th of the replica's GPUs). ``make_engine`` then runs once the replica's process has joined
    the group as rank 0, and each rank i > 0 runs ``python FOLLOWER_ARGS...`` in a child process of the replica,
    with torch.distributed's environment variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``): it joins the group, builds the same engine and follows rank 0's steps until rank 0 shuts down
    (``punica-hf serve ... --as-tp-rank`` does).

    ``stream_interval``: seconds a replica gathers a streamed answer's tokens before it sends them on (after the
    first, sent at once); 0 sends each as it comes. ``drain_seconds``: how long a stopping replica may take to
    answer the requests it holds before Ray Serve kills it (the ingress then answers them with errors;
    ``stop_seconds(drain_seconds)`` is how long the whole application may take to stop).
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if tp > 1 and not follower_args:
        raise ValueError("tp > 1 needs follower_args: the command line of the ranks 1.. of each replica")
    if isinstance(stream_interval, bool) or not isinstance(stream_interval, (int, float)) or not (
            0 <= stream_interval <= 10):
        raise ValueError(f"stream_interval must be a number of seconds in [0, 10], got {stream_interval!r}")
    check_seconds("drain_seconds", drain_seconds)
    limits = limits or RequestLimits()
    catalog = serve.deployment(AdapterCatalog, ray_actor_options={"num_cpus": 0}).bind()
    replica_class = serve.multiplexed(max_num_models_per_replica=max_adapters)(EngineReplica.hold_adapter)
    replica_class = type("EngineReplica", (EngineReplica,), {"hold_adapter": replica_class})
    replica = serve.deployment(
        replica_class, num_replicas=replicas, max_ongoing_requests=MAX_ONGOING_REQUESTS,
        ray_actor_options=dict(replica_actor_options or {}), health_check_period_s=HEALTH_CHECK_SECONDS,
        graceful_shutdown_timeout_s=drain_seconds,
    ).bind(make_engine, model_name, catalog, api_key, None if lora_dirs is None else list(lora_dirs), limits, tp,
           list(follower_args), float(stream_interval))
    router = serve.deployment(
        serve.ingress()(Router), max_ongoing_requests=MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=stop_seconds(drain_seconds),
    )
    return router.bind(replica, catalog, model_name, limits.max_body_bytes, api_key)


def stop_seconds(drain_seconds: float) -> float:
    """How long the application of ``build_app(..., drain_seconds=...)`` may take to stop: its ingress's drain."""
    return drain_seconds + RETRY_SECONDS + INGRESS_MARGIN_SECONDS


CatalogVersion = tuple[str, int]  # (the catalog's epoch, its number of changes)


class AdapterCatalog:
    """The adapters loaded and unloaded at runtime: each name's last change (a path, or None for an unload) and
    the version it was made at; the version grows with every change. ``epoch`` tells one catalog from the one Ray
    Serve starts if this one dies (its versions start again from 0)."""

    def __init__(self) -> None:
        self.epoch = uuid.uuid4().hex
        self.version = 0
        self.changes: dict[str, tuple[int, str | None]] = {}

    def snapshot(self) -> tuple[CatalogVersion, dict[str, tuple[int, str | None]]]:
        return (self.epoch, self.version), dict(self.changes)

    def current_version(self) -> CatalogVersion:
        return self.epoch, self.version

    def record(self, name: str, path: str | None, known: CatalogVersion | None) -> CatalogVersion:
        """Record a load (``path``) or an unload (None) of ``name`` by a replica whose last change of the name was
        the one made at ``known`` (None: none of this catalog's); the version it is made at. ``NameChangedElsewhere``
        when the name's last change here is another one: another replica changed it first, and the replica undoes
        its change."""
        last = self.changes.get(name)
        if known is not None and known[0] != self.epoch:  # a change of a catalog that died since: not this one's
            known = None
        if known != (None if last is None else (self.epoch, last[0])):
            raise NameChangedElsewhere(f"the adapter {name!r} was loaded or unloaded on another replica meanwhile; "
                                       "list the models and retry")
        self.version += 1
        self.changes[name] = (self.version, path)
        return self.epoch, self.version


class NameChangedElsewhere(ValueError):
    """A replica's load or unload of a name another replica changed first: refused by the catalog."""


class EngineReplica:
    """One engine and its server; ``handle_http`` serves one HTTP request, given as a dict, as batches of ASGI
    messages.

    Over ``tp`` > 1 ranks, the replica's process is rank 0 and ``followers`` the other ranks' processes."""

    async def __init__(self, make_engine: Callable[[], Engine], model_name: str, catalog, api_key: str | None,
                       lora_dirs: list[str] | None, limits: RequestLimits, tp: int = 1,
                       follower_args: Sequence[str] = (), stream_interval: float = STREAM_INTERVAL_SECONDS) -> None:
        # Ray Serve runs the constructor on the thread that runs the replica's event loop, for the replica's whole
        # life: the followers are started from it (see FollowerRanks).
        self.followers = FollowerRanks(tp, follower_args) if tp > 1 else None
        self.loop = asyncio.get_running_loop()  # where calls to other deployments are made and awaited
        try:
            self.engine = make_engine() if self.followers is None else self.followers.join_and(make_engine)
            self.catalog = catalog
            self.stream_interval = stream_interval
            self.app = create_app(self.engine, model_name, api_key=api_key, lora_dirs=lora_dirs, limits=limits,
                                  on_adapters_changed=self._record_in_catalog)
            self.name = serve.get_replica_context().replica_id.unique_id
            lowered = _priority_below_parent()
            if lowered > 0:  # Ray's default for its workers: 15
                logger.warning("replica %s runs %d nice levels below the Ray process that started it: its engine's "
                               "host work yields to Ray's own processes, and to other processes of the priority "
                               "the node runs at (start the cluster's nodes with RAY_worker_niceness=0)",
                               self.name, lowered)
            self.version: CatalogVersion = ("", 0)  # the catalog version this replica has caught up to
            self.applied: dict[str, CatalogVersion] = {}  # name -> the catalog change of it made here last
            self.superseded: set[str] = set()  # epochs of catalogs that died: a router may still carry one
            self.catching_up = asyncio.Lock()
            self.lifespan = _Lifespan(self.app)
            if self.followers is not None:  # the followers' engines run already: they wait for rank 0's steps
                await self.lifespan.start()  # (for minutes at most), not for this replica's first request
        except BaseException:
            if self.followers is not None:
                self.followers.stop(timeout=0)
            raise

    async def hold_adapter(self, adapter: str) -> str:
        """Made ``@serve.multiplexed`` by ``build_app``: tells Ray Serve this replica holds ``adapter``. The
        adapter's weights are the store's to move (device slots, host memory, disk), so there is nothing to load
        or free here."""
        return adapter

    async def handle_http(self, request: dict, catalog_version: int) -> AsyncIterator[list[dict]]:
        taken = time.perf_counter()
        await self.lifespan.start()
        app = self._lost_answer()
        if app is None:
            await self._catch_up(catalog_version)
            adapter = serve.get_multiplexed_model_id()
            if adapter and adapter in self.engine.model.adapters:
                await self.hold_adapter(adapter)
            app = self.app
        async for batch in _asgi_batches(app, request, self.stream_interval):
            if batch[0]["type"] == "http.response.start":
                first_ms = f"{1e3 * (time.perf_counter() - taken):.3f}"
                headers = [*batch[0].get("headers", []), (REPLICA_HEADER.encode(), self.name.encode()),
                           (FIRST_BATCH_HEADER.encode(), first_ms.encode())]
                batch[0] = {**batch[0], "headers": headers}
            yield batch

    def _lost_answer(self):
        """The 503 every request gets, marked for the ingress to send it elsewhere, once this replica cannot run a
        step: a follower rank has exited, or the engine has stopped (Ray Serve replaces the replica, or is stopping
        it). None while it can."""
        try:
            if self.followers is not None:
                self.followers.check()
        except RuntimeError as error:
            message, code = f"{error}; retry", "replica_lost"
        else:
            if self.engine.running:
                return None
            message, code = "the engine of this replica is not running; retry", "engine_not_running"
        response = APIError(503, message, type="server_error", code=code).response()
        response.headers[LOST_REPLICA_HEADER] = "1"
        return response

    async def check_health(self) -> None:
        if self.followers is not None:
            self.followers.check()
        if self.lifespan.started and not self.engine.running:
            raise RuntimeError(f"the engine is not running: {self.engine.error}")

    async def __del__(self) -> None:  # Ray Serve awaits it when it stops the replica: drain the engine
        await self.lifespan.stop()  # over ranks: rank 0's engine tells the followers to stop once drained
        if self.followers is not None:
            await asyncio.to_thread(self.followers.stop, FOLLOWER_EXIT_SECONDS)

    async def _catch_up(self, version: CatalogVersion) -> None:
        """Make the catalog's runtime loads and unloads that this replica has not made yet, if it has not caught up
        to ``version``: each name as the catalog last changed it (a name loaded again from another path is
        unloaded first). A change that fails here is logged and skipped, not retried at every request."""
        if self._caught_up(version):
            return
        async with self.catching_up:
            if self._caught_up(version):
                return
            latest, changes = await self.catalog.snapshot.remote()
            if latest[0] != version[0]:  # asked by a router that read a catalog since replaced: once, not per request
                self.superseded.add(version[0])
            for name, (changed_at, path) in sorted(changes.items(), key=lambda item: item[1][0]):
                if self.applied.get(name) == (latest[0], changed_at):
                    continue  # made here (by this replica, or an earlier catch-up)
                try:  # through the engine: over ranks, rank 0's engine has every rank make the change
                    if name in self.engine.model.adapters:
                        await asyncio.to_thread(self.engine.unload_adapter, name)
                    if path is not None:
                        await asyncio.to_thread(self.engine.load_adapters, {name: path})
                except Exception:
                    logger.exception("replica %s: the catalog's %s of adapter %r failed here", self.name,
                                     "unload" if path is None else f"load from {path}", name)
                self.applied[name] = (latest[0], changed_at)
            self.version = latest

    def _caught_up(self, asked: CatalogVersion) -> bool:
        """Whether this replica has made every change up to ``asked`` (a replaced catalog's: nothing to make)."""
        held = self.version
        return asked[0] in self.superseded or (held[0] == asked[0] and asked[1] <= held[1])

    def _record_in_catalog(self, name: str, path: str | None) -> None:
        """Called in a worker thread of the app. The call to the catalog is made and awaited on the replica's event
        loop: where Ray Serve routes calls on that loop itself (``RAY_SERVE_THROUGHPUT_OPTIMIZED``), a handle's
        blocking ``result()`` is refused."""
        async def record() -> CatalogVersion:
            return await self.catalog.record.remote(name, path, self.applied.get(name))

        recorded = asyncio.run_coroutine_threadsafe(record(), self.loop)
        try:
            self.applied[name] = recorded.result(timeout=CATALOG_SECONDS)
        except concurrent.futures.TimeoutError:
            recorded.cancel()
            raise TimeoutError(f"the adapter catalog did not answer within {CATALOG_SECONDS:.0f} s") from None
        except NameChangedElsewhere as error:  # Ray's copy, with the catalog's traceback: the server answers 409
            raise ValueError(str(getattr(error, "cause", error))) from None


def _priority_below_parent() -> int:
    """How many nice levels this process runs below its parent (a Ray worker's: the raylet that started it). Ray
    adds ``RAY_worker_niceness`` to the raylet's nice value rather than setting one, so a node started niced as a
    whole (``nice``, systemd's ``Nice=``) gives its workers that priority too: only the difference is Ray's doing.
    0 where the parent cannot be read."""
    try:
        return os.getpriority(os.PRIO_PROCESS, 0) - os.getpriority(os.PRIO_PROCESS, os.getppid())
    except OSError:  # the parent is gone
        return 0


class Router:
    """The HTTP ingress: each request to a replica, by its adapter; the answer streamed back."""

    def __init__(self, replica, catalog, model_name: str, max_body_bytes: int, api_key: str | None = None) -> None:
        self.replica = replica
        self.catalog = catalog
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key
        self.catalog_version: int | None = None  # read at the first request

    def __serve_build_asgi_app__(self):
        app = BodySizeLimit(self._serve, max_bytes=self.max_body_bytes)
        # The replicas' servers check the key too; here it is checked before the body is read for its adapter
        return app if self.api_key is None else KeyRequired(app, api_key=self.api_key, open_paths=OPEN_PATHS)

    async def _serve(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await _answer_lifespan(receive, send)
        if scope["type"] != "http":
            return
        try:
            body = await _read_body(receive)
        except APIError as error:
            return await error.response()(scope, receive, send)
        request = {key: scope[key] for key in ("method", "path", "raw_path", "query_string", "headers",
                                               "http_version", "scheme", "client", "server") if key in scope}
        request["body"] = body
        try:
            await self._route(request, self._adapter_of(body), scope, receive, send)
        except DeploymentUnavailableError:  # raised by an assignment, before any answer was sent: nothing takes it
            error = APIError(503, "the server's replicas are stopping, or could not start: none can answer this "
                             "request; retry", type="server_error", code="replicas_unavailable")
            await error.response()(scope, receive, send)

    async def _route(self, request: dict, adapter: str, scope, receive, send) -> None:
        if scope["path"] not in ADAPTER_ROUTES:
            if self.catalog_version is None:
                self.catalog_version = await self.catalog.current_version.remote()
            await self._forward(request, adapter, scope, receive, send)
            return
        # A load or unload: its answer waits until this router carries the catalog's version with the change, so a
        # request the client sends once it has the answer reaches a replica that has made the change too.
        self.catalog_version = await self.catalog.current_version.remote()
        answer = []

        async def keep(message: dict) -> None:
            answer.append(message)

        if await self._forward(request, adapter, scope, receive, keep) == 200:
            with contextlib.suppress(DeploymentUnavailableError):  # the application is going: the change was made
                self.catalog_version = await self.catalog.current_version.remote()
        for message in answer:
            await send(message)

    async def _forward(self, request: dict, adapter: str, scope, receive, send) -> int | None:
        """Send ``request`` to a replica and its answer to the client; again while the replica is lost before any of
        the answer was sent (its actor died, or it answered that it cannot run a step), for ``RETRY_SECONDS`` at
        most.
        The answer's status."""
        deadline = asyncio.get_running_loop().time() + RETRY_SECONDS
        while True:
            lost_answer = await self._try_replica(request, adapter, send)
            if isinstance(lost_answer, int):
                return lost_answer
            if asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(RETRY_PAUSE_SECONDS)
        if lost_answer is None:
            error = APIError(503, "the replica serving this request stopped (Ray Serve restarts it, unless the "
                             "server is stopping); retry",
                             type="server_error", code="replica_lost")
            await error.response()(scope, receive, send)
        else:
            for message in lost_answer:
                await send(message)
        return 503

    async def _try_replica(self, request: dict, adapter: str, send) -> int | list[dict] | None:
        """One try: the answer's status once it is sent; or, when the replica was lost before any of it was sent,
        nothing sent and the replica's marked 503 (its messages) or None (its actor died)."""
        status, ended = None, False
        answer = self.replica.options(stream=True, multiplexed_model_id=adapter).handle_http.remote(
            request, self.catalog_version
        )
        try:
            batches = aiter(answer)
            first = await anext(batches)
            start = first[0]
            if start["status"] == 503 and _has_header(start, LOST_REPLICA_HEADER):
                return [*first, *[message async for batch in batches for message in batch]]
            status = start["status"]
            ended = await _send_batch(first, send)
            async for batch in batches:
                ended = await _send_batch(batch, send) or ended
            return status
        except REPLICA_LOST:
            if status is None:
                return None
            if ended:  # the whole answer is out: the replica died after it
                return status
            # Part of the answer is out, and sending the request again would repeat it: a stream ends with an
            # error event, any other answer by closing the connection.
            if status != 200 or _media_type(start) != "text/event-stream":
                raise
            await send({"type": "http.response.body", "body": LOST_STREAM_END, "more_body": False})
            return status
        except BaseException:
            answer.cancel()  # the client went away, or this task was cancelled: stop the replica's work
            raise

    def _adapter_of(self, body: bytes) -> str:
        """The adapter the request names for multiplexing ("" for none: the base model, or no JSON ``model``); a
        body that is no JSON object goes on as it is, for the replica's server to refuse."""
        try:
            model = json.loads(body).get("model") if body else None
        except (ValueError, AttributeError, RecursionError):  # RecursionError: JSON nested too deep
            return ""
        return model if isinstance(model, str) and model != self.model_name else ""


class _Lifespan:
    """The ASGI lifespan of an app run outside an ASGI server: ``start()`` runs its startup (once), ``stop()`` its
    shutdown."""

    def __init__(self, app) -> None:
        self.app = app
        self.started = False
        self._starting = asyncio.Lock()
        self._to_app: asyncio.Queue = asyncio.Queue()
        self._from_app: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        if self.started:
            return
        async with self._starting:
            if self.started:
                return
            self._task = asyncio.create_task(
                self.app({"type": "lifespan", "asgi": {"version": "3.0"}}, self._to_app.get, self._from_app.put)
            )
            await self._to_app.put({"type": "lifespan.startup"})
            message = await self._from_app.get()
            if message["type"] != "lifespan.startup.complete":
                raise RuntimeError(f"the server did not start: {message.get('message', message['type'])}")
            self.started = True

    async def stop(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._to_app.put({"type": "lifespan.shutdown"})
        await self._from_app.get()


async def _asgi_batches(app, request: dict, interval: float) -> AsyncIterator[list[dict]]:
    """Run ``app`` on one HTTP request (a dict of its scope and ``body``); its response's ASGI messages, in
    batches: the response's start with the first body message at once (the first token's latency), then what the
    app sent in each ``interval`` seconds from the first message after a batch went out, consecutive body messages
    joined into one. When the consumer stops early (the client went away), the app sees a disconnect."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "root_path": "",
             **{key: value for key, value in request.items() if key != "body"}}
    scope.setdefault("raw_path", scope["path"].encode())
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request["body"], "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    batching = _Batching(interval)

    async def run() -> None:
        try:
            await app(scope, receive, batching.send)
        finally:
            batching.end()

    task = asyncio.create_task(run())
    answered = False  # the whole answer went out, and what the app raised goes to the consumer
    try:
        while True:
            await batching.due.wait()
            if batching.ended and not batching:  # what came while the last batch was out has gone too
                break
            batch = batching.take()
            if batch:
                yield batch
        answered = True
        await task  # raises what the app raised
    finally:
        batching.end()  # what the app sends from now on has no one to go to
        batching.stop_timer()
        gone.set()
        # The consumer left early (its client went away): what the app raises then has only the log to go to.
        try:
            if not task.done():
                await asyncio.wait_for(task, timeout=5)
            elif not answered and not task.cancelled():
                task.result()  # raises what the app raised
        except asyncio.TimeoutError:
            pass
        except Exception:
            logger.exception("the app failed after the consumer of its answer had left")


class _Batching:
    """The app's ``send``: each message joins the batch, and ``due`` is set when the batch should go out (the
    response's first body message, every message with a zero interval, ``interval`` seconds after the first message
    following a batch, the answer's end). One timer per batch, none per message: a replica streams every token of
    its requests through here, beside the engine's host work in the same process."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.due = asyncio.Event()
        self.ended = False  # the answer's last message came, or the app returned
        self._batch = _Batch()
        self._first_body = True
        self._timer: asyncio.TimerHandle | None = None

    def __bool__(self) -> bool:
        return bool(self._batch)

    async def send(self, message: dict) -> None:
        if self.ended:  # after the answer's last message (the consumer may have gone): nothing more goes out
            return
        self._batch.add(message)
        is_body = message["type"] == "http.response.body"
        if is_body and not message.get("more_body", False):
            self.end()
        elif is_body and (self._first_body or self.interval <= 0):
            self._first_body = False
            self.due.set()
        elif self._timer is None and not self._first_body:
            self._start_timer()

    def end(self) -> None:
        self.ended = True
        self.due.set()

    def take(self) -> list[dict]:
        """The batch's messages; the next message starts the next interval."""
        self.stop_timer()
        if not self.ended:
            self.due.clear()
        return self._batch.take()

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _start_timer(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self.interval, self.due.set)


class _Batch:
    """ASGI messages going out together, consecutive body messages joined into one (once, as the batch goes out:
    a backlog of many small ones costs its bytes, not its bytes times their number)."""

    def __init__(self) -> None:
        self._messages: list[dict] = []
        self._body: list[bytes] = []  # the pieces of a body message still being joined
        self._more_body = False

    def __bool__(self) -> bool:
        return bool(self._messages or self._body)

    def add(self, message: dict) -> None:
        if message["type"] == "http.response.body":
            self._body.append(bytes(message.get("body", b"")))
            self._more_body = message.get("more_body", False)
            return
        self._end_body()
        self._messages.append(message)

    def take(self) -> list[dict]:
        """The batch's messages; it is empty after."""
        self._end_body()
        messages, self._messages = self._messages, []
        return messages

    def _end_body(self) -> None:
        if self._body:
            body, self._body = b"".join(self._body), []
            self._messages.append({"type": "http.response.body", "body": body, "more_body": self._more_body})


def _has_header(start: dict, name: str) -> bool:
    """Whether an ASGI ``http.response.start`` message carries the header ``name`` (lower case)."""
    return any(bytes(key).lower() == name.encode() for key, _ in start.get("headers", []))


def _media_type(start: dict) -> str | None:
    """The media type of a ``http.response.start`` message's content type (lower case, no parameters); None without
    one."""
    for key, value in start.get("headers", []):
        if bytes(key).lower() == b"content-type":
            return bytes(value).decode("latin-1").split(";")[0].strip().lower()
    return None


async def _send_batch(messages: list[dict], send) -> bool:
    """Send a batch of an answer's ASGI messages; whether its last one ended the answer's body."""
    for message in messages:
        await send(message)
    last = messages[-1] if messages else {}
    return last.get("type") == "http.response.body" and not last.get("more_body", False)


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks)
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _answer_lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
