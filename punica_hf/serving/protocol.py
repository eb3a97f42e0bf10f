"""The OpenAI-compatible wire format: request bodies (validated by FastAPI) and response bodies.

Field names and defaults follow OpenAI's completions and chat completions APIs, plus the extensions vLLM
clients send (``top_k``, ``stop_token_ids``, ``ignore_eos``) and vLLM's runtime LoRA bodies. Fields OpenAI
defines that this server does not implement are accepted only at their neutral value (``n=1``, no ``logprobs``,
no ``echo``, ...): anything else is a 400 naming the field. Unknown fields are ignored, as OpenAI does.

Types follow OpenAI's schema strictly: numbers are JSON numbers (not strings), booleans are JSON booleans, a
``prompt`` is a string, a list of strings, a list of token ids or a list of lists of token ids. Text must be valid
Unicode (a lone surrogate, which JSON's ``\ud800`` escapes can carry, cannot be encoded and is refused).

Adapter names (``lora_name``, ``punica-hf serve --adapter NAME=...``) follow a Hugging Face Hub repo id's
characters and length: ``names.ADAPTER_NAME_RULES``.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from .engine import Completion, SamplingParams
from .names import check_adapter_name

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions (also when null)


def _encodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"text holds a lone surrogate (U+{ord(text[error.start]):04X}): not valid Unicode") from None
    return text


def _without_nul(path: str) -> str:
    if "\0" in path:
        raise ValueError("a path cannot hold a NUL character")
    return path


Text = Annotated[str, AfterValidator(_encodable)]  # text that reaches a tokenizer, or is echoed in an answer
AdapterName = Annotated[str, AfterValidator(check_adapter_name)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = True  # usage is always sent (a last chunk without choices); accepted for compatibility


class _SamplingFields(_Body):
    """What completions and chat completions share: the model (adapter) and how to generate."""

    model: Text
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM: -1 or 0 = off
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # OpenAI fields this server does not implement: only their neutral values are accepted
    n: int = 1
    logprobs: Any = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _only_neutral_unsupported_fields(self):
        unsupported = {
            "n": self.n != 1,
            "logprobs": self.logprobs not in (None, False, 0),
            "top_logprobs": self.top_logprobs not in (None, 0),
            "presence_penalty": self.presence_penalty not in (None, 0),
            "frequency_penalty": self.frequency_penalty not in (None, 0),
            "logit_bias": bool(self.logit_bias),
        }
        unsupported.update(self._more_unsupported())
        named = [name for name, used in unsupported.items() if used]
        if named:
            raise ValueError(f"not supported by this server: {', '.join(named)}")
        return self

    def _more_unsupported(self) -> dict[str, bool]:
        return {}

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        """The engine settings; OpenAI's defaults: temperature 1, top_p 1 (``temperature=0`` is greedy)."""
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            seed=self.seed,
            stop=() if self.stop is None else self.stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a text, a list of texts, token ids, or a list of token id lists."""

    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=DEFAULT_COMPLETION_TOKENS, ge=1)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def _more_unsupported(self) -> dict[str, bool]:
        return {"echo": self.echo, "best_of": self.best_of not in (None, 1), "suffix": bool(self.suffix)}

    def max_new_tokens(self) -> int:
        return DEFAULT_COMPLETION_TOKENS if self.max_tokens is None else self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: a text or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise ValueError("prompt is empty")
        return list(prompt)


class ContentPart(_Body):
    type: str
    text: Text | None = None


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[ContentPart] | None = None

    def text(self) -> str:
        """The message's text; a list of content parts must hold text parts only."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" for part in self.content):
            raise ValueError("only text content parts are supported")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: the prompt is the tokenizer's chat template applied to ``messages``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def chat(self) -> list[dict[str, str]]:
        return [{"role": message.role, "content": message.text()} for message in self.messages]


class LoadLoraAdapterRequest(_Body):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    lora_name: AdapterName
    lora_path: Annotated[str, Field(min_length=1), AfterValidator(_without_nul), AfterValidator(_encodable)]


class UnloadLoraAdapterRequest(_Body):
    """vLLM's ``POST /v1/unload_lora_adapter`` body."""

    lora_name: Annotated[Text, Field(min_length=1)]  # any name: one that is not loaded is a 404


# ---------------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, completions: list[Completion]) -> Usage:
        prompt = sum(c.prompt_tokens for c in completions)
        generated = sum(c.completion_tokens for c in completions)
        return cls(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # a stream's chunks carry none, except the last one (which has no choices)


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "punica-hf"
    parent: str | None = None  # adapters: the base model's id
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


# The server-sent events of a streamed answer: one per body, then the end OpenAI's clients wait for.
STREAM_END = "data: [DONE]\n\n"


def stream_event(body: BaseModel) -> str:
    """``body`` as one server-sent event."""
    return f"data: {body.model_dump_json()}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
