"""Text around the engine: the tokenizers it accepts, and a request's tokens turned into text as they arrive.

The engine works on token ids; text only enters through a tokenizer: an object with ``encode(text) -> ids`` and
``decode(ids) -> text`` (``encode_chat(messages) -> ids`` for chat requests). ``as_tokenizer`` wraps a transformers
tokenizer that way; ``DemoTokenizer`` is the packaged demo model's byte tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from .. import demo

REPLACEMENT_CHARACTER = "\ufffd"  # what a decoder prints for an incomplete UTF-8 sequence


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]: ...


class HFTokenizer:
    """A transformers tokenizer: special tokens (BOS) added when encoding, skipped when decoding."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The prompt of a chat: the tokenizer's chat template, ending with the assistant's turn."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template: use /v1/completions")
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])  # the template holds BOS


class DemoTokenizer:
    """The demo model's tokenizer: BOS, then the UTF-8 bytes of the text. It has no chat template."""

    def encode(self, text: str) -> list[int]:
        return [demo.BOS_ID, *demo.encode(text)]

    def decode(self, token_ids: Sequence[int]) -> str:
        return demo.decode(list(token_ids))

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        raise ValueError("the demo model has no chat template: use /v1/completions with a prompt like 'lora='")


def as_tokenizer(tokenizer) -> Tokenizer:
    """``tokenizer`` as the engine uses it: transformers tokenizers are wrapped, anything else is taken as is."""
    from transformers import PreTrainedTokenizerBase

    return HFTokenizer(tokenizer) if isinstance(tokenizer, PreTrainedTokenizerBase) else tokenizer


class TextStream:
    """One request's text, built piece by piece as its tokens arrive, cut at the first of its stop strings.

    Decoding is incremental (each call decodes a few tokens, not the whole answer): the tokens since the last
    emitted piece are decoded together with the tokens before them, and the new text is the difference; a piece
    that ends in an incomplete UTF-8 sequence waits for the next token. Text that could be the beginning of a
    stop string is held back until the next tokens show it is not (so a stop string is never streamed in part).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._tokens: list[int] = []
        self._prefix_offset = 0  # tokens[prefix:read] were decoded already; they give the next piece its context
        self._read_offset = 0
        self.text = ""  # the text so far (cut at the stop string once one appeared)
        self._emitted = 0  # characters of ``text`` already handed out
        self.stopped = False  # a stop string appeared: nothing is added after it

    def add(self, token_ids: Sequence[int]) -> str:
        """Take the next tokens; return the text that can be handed out now (possibly "")."""
        if self.stopped or not token_ids:
            return ""
        self._tokens.extend(token_ids)
        seen = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        current = self._decode(self._tokens[self._prefix_offset :])
        if len(current) <= len(seen) or current.endswith(REPLACEMENT_CHARACTER):
            return ""
        searched_from = max(0, len(self.text) - max(map(len, self._stop), default=0) + 1)
        self.text += current[len(seen) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        stop_at = min((i for s in self._stop if (i := self.text.find(s, searched_from)) >= 0), default=-1)
        if stop_at >= 0:
            self.text = self.text[:stop_at]
            self.stopped = True
            return self._take(len(self.text))
        return self._take(len(self.text) - self._partial_stop_length())

    def finish(self) -> str:
        """The text held back so far: call once the request has ended."""
        return self._take(len(self.text))

    def _partial_stop_length(self) -> int:
        """Length of the longest end of ``text`` that is the beginning of a stop string."""
        return max(
            (n for stop in self._stop for n in range(1, len(stop)) if self.text.endswith(stop[:n])), default=0
        )

    def _take(self, end: int) -> str:
        piece = self.text[self._emitted : max(end, self._emitted)]
        self._emitted += len(piece)
        return piece
