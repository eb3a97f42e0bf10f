"""The OpenAI-compatible HTTP server around an ``Engine`` (FastAPI; run it with uvicorn, or ``punica-hf serve``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` for server-sent events),
``GET /v1/models``, ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's bodies; only when
runtime loading is on, and only from paths under the allowed directories), ``GET /health``, ``GET /metrics``.
The request's ``model`` names an adapter, or the base model. Errors are OpenAI's error JSON: 400 bad body, too
long or beyond the ``RequestLimits``, 401 wrong or missing API key (every route but ``/health``), 404 unknown
model (or an adapter unloaded while the request waited), 413 body too large, 429 queue full, 500 this request's
generation failed (the others go on) or an unexpected error (no internals shown), 503 the engine is not running
(or shut down before the request finished: ``Engine.shutdown``'s ``drain_seconds``);
every answer, 500s too, is JSON. Text prompts are tokenized on a few threads, off the event loop, so a long prompt
does not hold up the other clients; one longer than the tokenizer could ever make fit (``max_chars_per_token``) is
refused before it is tokenized. A client that disconnects has its requests cancelled (their KV blocks freed). The
app starts the engine and, when the server shuts down (SIGTERM), lets it finish the requests in flight. With an API
key, ``/openapi.json`` needs it too and ``/docs`` and ``/redoc`` are off (a browser page cannot send the key). No
response shows a file system path.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import (
    ADAPTER_NOT_FOUND,
    SHUT_DOWN,
    Completion,
    Delta,
    Engine,
    EngineClosedError,
    QueueFullError,
    RequestHandle,
    SamplingParams,
)
from .metrics import ServingMetrics
from .names import shortened
from .protocol import (
    STREAM_END,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoraAdapterRequest,
    Usage,
    new_id,
    stream_event,
)
from .text import PromptTooLong, check_prompt_chars

DISCONNECT_POLL_SECONDS = 0.25  # how often a non-streaming request checks that its client is still there
TOKENIZER_THREADS = 2  # prompts tokenized at once (HF tokenizers release the GIL while they work); others wait


@dataclass(frozen=True)
class RequestLimits:
    """What one HTTP request may ask for; a request beyond is refused before it reaches the engine.

    Args:
        max_body_bytes: request body size (413 beyond, refused before the body is read).
        max_prompts: prompts in one ``/v1/completions`` request (each is a request of the engine).
        max_stop_sequences: stop strings, and stop token ids, of one request (at most this many of each).
        max_stop_length: characters of one stop string.
    """

    max_body_bytes: int = 4 * 1024 * 1024
    max_prompts: int = 32
    max_stop_sequences: int = 16
    max_stop_length: int = 512

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompts", "max_stop_sequences", "max_stop_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def check(self, body: CompletionRequest | ChatCompletionRequest, prompts: int = 1) -> None:
        """Raise ``ValueError`` naming the first limit ``body`` is beyond."""
        if prompts > self.max_prompts:
            raise ValueError(f"prompt: {prompts} prompts in one request; this server takes at most {self.max_prompts}")
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stop) > self.max_stop_sequences:
            raise ValueError(f"stop: {len(stop)} stop strings; this server takes at most {self.max_stop_sequences}")
        too_long = max(map(len, stop), default=0)
        if too_long > self.max_stop_length:
            raise ValueError(
                f"stop: a stop string of {too_long} characters; this server takes at most {self.max_stop_length}"
            )
        stop_token_ids = body.stop_token_ids or []
        if len(stop_token_ids) > self.max_stop_sequences:
            raise ValueError(
                f"stop_token_ids: {len(stop_token_ids)} ids; this server takes at most {self.max_stop_sequences}"
            )


class APIError(StarletteHTTPException):
    """An error answered with OpenAI's error JSON (an HTTPException, so FastAPI also answers one raised while it
    reads a request body)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(status, message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status)


def create_app(
    engine: Engine,
    model_name: str,
    *,
    api_key: str | None = None,
    lora_dirs: Sequence[str | Path] | None = None,
    limits: RequestLimits | None = None,
    on_adapters_changed: Callable[[str, str | None], None] | None = None,
) -> FastAPI:
    """The server of ``engine`` (not started yet: the app starts it, and drains it on shutdown).

    ``model_name`` is the base model's id in the API. ``lora_dirs`` turns on runtime adapter loading, from paths
    under those directories only (symlinks resolved); None keeps it off. ``limits``: what one request may ask for
    (default ``RequestLimits()``). ``on_adapters_changed(name, path)`` is called after a runtime load succeeds
    (``path`` None after an unload) and before the client is answered, so that other copies of the server (Ray
    Serve replicas) can follow; if it raises, a load is undone and the client gets a 503, or a 409 with its message
    for a ``ValueError`` (the others refuse the change: another copy changed that name first).
    """
    check_api_key(api_key)
    limits = limits or RequestLimits()
    server = _Server(engine, model_name, lora_dirs, on_adapters_changed)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        server.tokenizer_threads.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(engine.shutdown, True)

    # With a key, the schema is served by the keyed router below; the docs pages are off (a browser sends no key).
    documented = api_key is None
    app = FastAPI(
        title="punica-hf", summary="OpenAI-compatible multi-LoRA serving", lifespan=lifespan,
        openapi_url="/openapi.json" if documented else None, docs_url="/docs" if documented else None,
        redoc_url="/redoc" if documented else None,
    )
    app.state.server = server
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes)
    if api_key is not None:  # added last, so it runs first: before a body is read, or its size is told
        app.add_middleware(KeyRequired, api_key=api_key, open_paths=OPEN_PATHS)

    api = APIRouter()

    @api.post("/v1/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest, request: Request):
        adapter = server.adapter_for(body.model)
        prompts = _bad_request_on_value_error(body.prompts)
        _bad_request_on_value_error(lambda: limits.check(body, prompts=len(prompts)))
        params = _bad_request_on_value_error(lambda: body.sampling_params(body.max_new_tokens()))
        prompts = await server.prompt_ids(prompts, params.max_new_tokens)
        handles = server.submit([(prompt, adapter, params) for prompt in prompts])
        response_id = new_id("cmpl")
        if body.stream:
            return _event_stream(server.stream_completion(response_id, body.model, handles), handles)
        results = await _results_unless_disconnected(request, handles)
        if results is None:
            return Response(status_code=499)
        choices = [CompletionChoice(index=i, text=c.text, finish_reason=c.finish_reason) for i, c in enumerate(results)]
        return CompletionResponse(id=response_id, model=body.model, choices=choices, usage=Usage.of(results))

    @api.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        adapter = server.adapter_for(body.model)
        _bad_request_on_value_error(lambda: limits.check(body))
        messages = _bad_request_on_value_error(body.chat)
        prompt_ids = await server.chat_prompt_ids(messages, body.requested_max_tokens() or 1)
        max_tokens = body.requested_max_tokens() or max(engine.max_model_len - len(prompt_ids), 1)
        params = _bad_request_on_value_error(lambda: body.sampling_params(max_tokens))
        handles = server.submit([(prompt_ids, adapter, params)])
        response_id = new_id("chatcmpl")
        if body.stream:
            return _event_stream(server.stream_chat(response_id, body.model, handles[0]), handles)
        results = await _results_unless_disconnected(request, handles)
        if results is None:
            return Response(status_code=499)
        (result,) = results
        choice = ChatChoice(index=0, message=ChatMessageOut(content=result.text), finish_reason=result.finish_reason)
        return ChatCompletionResponse(id=response_id, model=body.model, choices=[choice], usage=Usage.of(results))

    @api.get("/v1/models", response_model=ModelList)
    async def models():
        return server.model_list()

    @api.get("/metrics")
    async def metrics():
        content, content_type = server.metrics.render()
        return Response(content, media_type=content_type)

    if not documented:

        @api.get("/openapi.json", include_in_schema=False)
        async def openapi_schema():
            return JSONResponse(app.openapi())

    if lora_dirs is not None:

        @api.post("/v1/load_lora_adapter")
        def load_lora_adapter(body: LoadLoraAdapterRequest):  # blocking file reads: FastAPI runs it in a thread
            server.load_adapter(body.lora_name, body.lora_path)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

        @api.post("/v1/unload_lora_adapter")
        def unload_lora_adapter(body: UnloadLoraAdapterRequest):
            server.unload_adapter(body.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    app.include_router(api)

    @app.get("/health")
    async def health():
        if not engine.running:
            raise APIError(503, "the engine is not running", type="server_error", code="engine_not_running")
        return {"status": "ok"}

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        problems = [(_field_path(problem["loc"]), problem["msg"]) for problem in error.errors()]
        described = "; ".join(f"{path or 'body'}: {message}" for path, message in problems)
        return APIError(400, f"invalid request: {described}", param=problems[0][0] if problems else None).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        return APIError(error.status_code, str(error.detail), code=str(error.status_code)).response()

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception):  # the traceback goes to the log, not the client
        return APIError(500, "internal server error", type="server_error", code="internal_error").response()

    return app


class _Server:
    """The state behind the routes: the engine, the base model's name, the allowed adapter directories, metrics."""

    def __init__(self, engine: Engine, model_name: str, lora_dirs: Sequence[str | Path] | None,
                 on_adapters_changed: Callable[[str, str | None], None] | None = None) -> None:
        self.engine = engine
        self.on_adapters_changed = on_adapters_changed
        self.model_name = model_name
        self.lora_dirs = None if lora_dirs is None else [Path(os.path.realpath(d)) for d in lora_dirs]
        self.metrics = ServingMetrics(engine)
        self.created = int(time.time())
        self.tokenizer_threads = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")

    # -------------------------------------------------------------- models
    def adapter_for(self, model: str) -> str | None:
        """The adapter a request's ``model`` names (None for the base model); 404 for anything else."""
        if model == self.model_name:
            return None
        if model in self.engine.model.adapters:
            return model
        raise _model_not_found(model)

    def model_list(self) -> ModelList:
        """The base model and every adapter, by name only (where their weights came from is the operator's)."""
        base = ModelCard(id=self.model_name, created=self.created, max_model_len=self.engine.max_model_len)
        adapters = [
            ModelCard(id=name, created=self.created, parent=self.model_name)
            for name in sorted(self.engine.model.adapters)
        ]
        return ModelList(data=[base, *adapters])

    def load_adapter(self, name: str, path: str) -> None:
        if name == self.model_name or name in self.engine.model.adapters:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        resolved = Path(os.path.realpath(path))
        if not any(resolved == allowed or allowed in resolved.parents for allowed in self.lora_dirs):
            raise APIError(400, f"lora_path '{path}' is not under a directory the server allows (--lora-dir)",
                           param="lora_path")
        if not resolved.exists():
            raise APIError(400, f"lora_path '{path}' does not exist", param="lora_path")
        try:
            self.engine.load_adapters({name: str(resolved)})
        except (ValueError, KeyError, OSError) as error:  # named by the client's path: the real one is the operator's
            message = str(error).replace(str(resolved), path)
            raise APIError(400, f"could not load '{path}': {message}", param="lora_path") from error
        self._tell_others(name, str(resolved), undo=lambda: self.engine.unload_adapter(name))

    def unload_adapter(self, name: str) -> None:
        # One call that checks and removes: a check before it could pass for two concurrent unloads of one name.
        try:
            self.engine.unload_adapter(name)  # requests using it finish first; its name is free at once
        except KeyError:  # its message lists every adapter loaded: not for this client
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="model_not_found") from None
        self._tell_others(name, None, undo=None)

    def _tell_others(self, name: str, path: str | None, undo: Callable[[], None] | None) -> None:
        """Call ``on_adapters_changed``; if it fails, ``undo`` the change here (an unload cannot be undone: its
        requests may have finished already) and answer 503."""
        if self.on_adapters_changed is None:
            return
        try:
            self.on_adapters_changed(name, path)
        except Exception as error:
            if undo is not None:
                try:
                    undo()
                except KeyError:  # unloaded meanwhile by another call: nothing left to undo
                    pass
            if isinstance(error, ValueError):  # refused by the others
                raise APIError(409, str(error), param="lora_name", code="conflict") from error
            raise APIError(503, f"the other replicas could not be told about '{name}': {error}",
                           type="server_error", code="replicas_not_told") from error

    # -------------------------------------------------------------- requests
    async def prompt_ids(self, prompts: list[str | list[int]], max_new_tokens: int) -> list[str | list[int]]:
        """The prompts with each text tokenized (off the event loop); 400 for one that cannot fit, refused by its
        length before any is tokenized. Without a tokenizer texts stay texts: the engine refuses them."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            return prompts
        max_chars = self._max_prompt_chars(max_new_tokens)
        try:
            for text in (prompt for prompt in prompts if isinstance(prompt, str)):
                check_prompt_chars(text, max_chars)
        except PromptTooLong as error:
            raise self._refusal(error, max_new_tokens) from error
        return [
            await self._tokenized(tokenizer.encode, prompt, max_new_tokens) if isinstance(prompt, str) else prompt
            for prompt in prompts
        ]

    async def chat_prompt_ids(self, messages: list[Mapping[str, str]], max_new_tokens: int) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "this server has no tokenizer: chat needs one")
        max_chars = self._max_prompt_chars(max_new_tokens)
        encode = tokenizer.encode_chat if max_chars is None else partial(tokenizer.encode_chat, max_chars=max_chars)
        return await self._tokenized(encode, messages, max_new_tokens)

    def _max_prompt_chars(self, max_new_tokens: int) -> int | None:
        """The longest text that could fit beside ``max_new_tokens`` (None: not known for this tokenizer)."""
        per_token = getattr(self.engine.tokenizer, "max_chars_per_token", None)
        return None if per_token is None else max(self.engine.max_model_len - max_new_tokens, 0) * per_token

    async def _tokenized(self, encode, prompt, max_new_tokens: int) -> list[int]:
        try:
            return await asyncio.get_running_loop().run_in_executor(self.tokenizer_threads, encode, prompt)
        except ValueError as error:
            raise self._refusal(error, max_new_tokens) from error

    def _refusal(self, error: ValueError, max_new_tokens: int) -> APIError:
        """The 400 of a prompt refused; one too long in the words of the engine's own refusal."""
        if not isinstance(error, PromptTooLong):
            return APIError(400, str(error))
        limit = self.engine.max_model_len
        return APIError(
            400, f"the prompt ({error.chars} characters: over {max(limit - max_new_tokens, 0)} tokens) plus "
            f"max_new_tokens ({max_new_tokens}) exceeds the {limit}-token limit of this engine",
        )

    def submit(self, requests: list[tuple[str | list[int], str | None, SamplingParams]]) -> list[RequestHandle]:
        """Submit all (one choice each) or none: nothing of a refused request is queued, run or counted."""
        try:
            handles = self.engine.submit_all(requests)
        except Exception as error:
            if isinstance(error, KeyError):  # unloaded since adapter_for: name it alone, not every adapter loaded
                raise _model_not_found(requests[0][1]) from error
            if isinstance(error, ValueError):
                raise APIError(400, str(error)) from error
            if isinstance(error, QueueFullError):
                raise APIError(429, str(error), type="server_overloaded", code="queue_full") from error
            if isinstance(error, EngineClosedError):
                raise APIError(503, str(error), type="server_error", code="engine_not_running") from error
            raise
        for handle in handles:
            self.metrics.track(handle)
        return handles

    async def stream_completion(self, response_id: str, model: str, handles: list[RequestHandle]) -> AsyncIterator[str]:
        async with aclosing(_merged(handles)) as pieces:
            async for index, delta in pieces:
                if delta.finish_reason == "error":
                    yield _error_event(handles[index])
                    return
                if delta.text or delta.finish_reason:
                    choice = CompletionChoice(index=index, text=delta.text, finish_reason=delta.finish_reason)
                    yield stream_event(CompletionResponse(id=response_id, model=model, choices=[choice]))
        usage = Usage.of([handle.result(timeout=0) for handle in handles])
        yield stream_event(CompletionResponse(id=response_id, model=model, choices=[], usage=usage))

    async def stream_chat(self, response_id: str, model: str, handle: RequestHandle) -> AsyncIterator[str]:
        def chunk(delta: ChatDelta, finish_reason: str | None = None) -> str:
            choice = ChatChunkChoice(index=0, delta=delta, finish_reason=finish_reason)
            return stream_event(ChatCompletionChunk(id=response_id, model=model, choices=[choice]))

        yield chunk(ChatDelta(role="assistant", content=""))
        async with aclosing(aiter(handle)) as pieces:
            async for delta in pieces:
                if delta.finish_reason == "error":
                    yield _error_event(handle)
                    return
                if delta.text:
                    yield chunk(ChatDelta(content=delta.text))
                if delta.finish_reason:
                    yield chunk(ChatDelta(), delta.finish_reason)
        usage = Usage.of([handle.result(timeout=0)])
        yield stream_event(ChatCompletionChunk(id=response_id, model=model, choices=[], usage=usage))


def _bad_request_on_value_error(make):
    try:
        return make()
    except ValueError as error:
        raise APIError(400, str(error)) from error


def _field_path(location: Sequence[str | int]) -> str:
    """A validation error's field, as ``messages.0.content``: its location without "body" and without the names
    pydantic gives the branches of a union (``str``, ``list[int]``, ``ContentPart``...)."""
    parts = []
    for part in location[1:] if location[:1] == ("body",) else location:
        if isinstance(part, str) and not part.isidentifier() or part in ("str", "int", "float", "bool", "none"):
            break
        if isinstance(part, str) and part[:1].isupper():
            continue  # a model's name in a union: the fields inside it follow
        parts.append(str(part))
    return ".".join(parts)


def _model_not_found(model: str) -> APIError:
    return APIError(404, f"The model '{shortened(model)}' does not exist", param="model", code="model_not_found")


async def _results_unless_disconnected(request: Request, handles: list[RequestHandle]) -> list[Completion] | None:
    """The requests' completions; None (and the requests cancelled) if the client goes away first."""

    async def completions() -> list[Completion]:
        return [await handle.aresult() for handle in handles]

    # One task, not a gather: a cancelled task ends quietly, a cancelled gather logs its unretrieved CancelledError.
    results = asyncio.create_task(completions())
    try:
        while not results.done():
            await asyncio.wait({results}, timeout=DISCONNECT_POLL_SECONDS)
            if not results.done() and await request.is_disconnected():
                return None
    finally:
        if not results.done():
            results.cancel()
            for handle in handles:
                handle.cancel()
    failed = next((c for c in results.result() if c.finish_reason == "error"), None)
    if failed is not None:
        raise _failure(failed)
    return results.result()


def _failure(completion: Completion) -> APIError:
    """The error of a failed request: 404 if its adapter was unloaded before it started, 503 if the server shut
    down before it finished (another server may answer it), else 500 (it failed alone)."""
    if completion.error_code == ADAPTER_NOT_FOUND:
        return _model_not_found(completion.adapter)
    if completion.error_code == SHUT_DOWN:
        return APIError(503, completion.error, type="server_error", code="shut_down")
    return APIError(500, f"generation failed: {completion.error}", type="server_error", code="generation_failed")


def _event_stream(events: AsyncIterator[str], handles: list[RequestHandle]) -> StreamingResponse:
    """Server-sent events ending with ``data: [DONE]``. When the client disconnects, Starlette cancels the
    stream: the requests are cancelled with it (a no-op for those that finished)."""

    async def body() -> AsyncIterator[str]:
        try:
            async with aclosing(events):
                async for event in events:
                    yield event
            yield STREAM_END
        finally:
            for handle in handles:
                handle.cancel()

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, Delta]]:
    """``(choice index, delta)`` of several requests as they come."""
    if len(handles) == 1:  # the usual case, every token of it: no task and queue between the handle and the stream
        async with aclosing(aiter(handles[0])) as deltas:
            async for delta in deltas:
                yield 0, delta
        return
    pieces: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        try:
            async for delta in handle:
                await pieces.put((index, delta))
        except Exception as error:  # to the stream, which would otherwise wait for this request's end forever
            await pieces.put((index, error))
            return
        await pieces.put((index, None))

    pumps = [asyncio.create_task(pump(index, handle)) for index, handle in enumerate(handles)]
    try:
        running = len(handles)
        while running:
            index, delta = await pieces.get()
            if isinstance(delta, Exception):
                raise delta
            if delta is None:
                running -= 1
            else:
                yield index, delta
    finally:
        for task in pumps:
            task.cancel()


def _error_event(handle: RequestHandle) -> str:
    failure = _failure(handle.result(timeout=0))
    error = ErrorDetail(message=failure.message, type=failure.type, param=failure.param, code=failure.code)
    return stream_event(ErrorResponse(error=error))


OPEN_PATHS = frozenset({"/health"})  # the paths a server with an API key serves to anyone


def check_api_key(api_key: str | None) -> None:
    """``ValueError`` for a key no client can send: empty (``--api-key "$KEY"`` with KEY unset would let in anyone
    who sends ``Bearer `` and nothing else), or with whitespace at an end (HTTP trims it from the header)."""
    if api_key is not None and (not isinstance(api_key, str) or not api_key or api_key != api_key.strip()):
        raise ValueError("the API key must be a non-empty string without whitespace at its ends")


class KeyRequired:
    """ASGI middleware: an HTTP request to any path but ``open_paths`` needs ``Authorization: Bearer <api_key>``,
    checked before any of its body is read: a client without the key gets a 401, never a parse of what it sent."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.open_paths = open_paths

    def _key_matches(self, scope) -> bool:
        value = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        scheme, _, credentials = value.partition(b" ")
        # the header's bytes are the key's UTF-8 bytes (curl's); auth schemes are case-insensitive (RFC 7235)
        return secrets.compare_digest(credentials.strip(b" "), self.api_key) and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or self._key_matches(scope):
            return await self.app(scope, receive, send)
        error = APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")
        await error.response()(scope, receive, send)


class BodySizeLimit:
    """ASGI middleware: a request body over ``max_bytes`` is refused with 413, by its Content-Length before any of
    it is read, or (sent in chunks) as soon as what arrived passes the limit."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> str:
        return f"the request body is larger than this server's limit of {self.max_bytes} bytes"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await APIError(413, self._too_large(), code="request_too_large").response()(scope, receive, send)
        received = 0

        async def receive_within_limit():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # raised while FastAPI reads the body: answered by the APIError handler
                raise APIError(413, self._too_large(), code="request_too_large")
            return message

        await self.app(scope, receive_within_limit, send)
