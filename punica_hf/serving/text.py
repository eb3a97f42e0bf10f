"""Text around the engine: the tokenizers it accepts, and a request's tokens turned into text as they arrive.

The engine works on token ids; text only enters through a tokenizer: an object with ``encode(text) -> ids`` and
``decode(ids) -> text`` (``encode_chat(messages) -> ids`` for chat requests). ``as_tokenizer`` wraps a transformers
tokenizer that way; ``DemoTokenizer`` is the packaged demo model's byte tokenizer.

A tokenizer may also say ``max_chars_per_token``: the most characters of text one token can stand for (None: no
such bound is known). A server uses it to refuse a prompt that cannot fit before spending the time to tokenize it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from .. import demo

REPLACEMENT_CHARACTER = "\ufffd"  # what a decoder prints for an incomplete UTF-8 sequence


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def encode_chat(self, messages: Sequence[Mapping[str, str]], max_chars: int | None = None) -> list[int]: ...


class PromptTooLong(ValueError):
    """A prompt with more characters than could ever fit, found before it was tokenized."""

    def __init__(self, chars: int, max_chars: int) -> None:
        super().__init__(f"the prompt has {chars} characters: more than {max_chars}, the most that could fit")
        self.chars = chars


def check_prompt_chars(text: str, max_chars: int | None) -> None:
    """``PromptTooLong`` if ``text`` has more than ``max_chars`` characters (None: no bound)."""
    if max_chars is not None and len(text) > max_chars:
        raise PromptTooLong(len(text), max_chars)


class HFTokenizer:
    """A transformers tokenizer: special tokens (BOS) added when encoding, skipped when decoding."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.max_chars_per_token = _max_chars_per_token(tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def encode_chat(self, messages: Sequence[Mapping[str, str]], max_chars: int | None = None) -> list[int]:
        """The prompt of a chat: the tokenizer's chat template, ending with the assistant's turn; ``ValueError``
        before tokenizing if that text is longer than ``max_chars``."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template: use /v1/completions")
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        check_prompt_chars(text, max_chars)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])  # the template holds BOS


class DemoTokenizer:
    """The demo model's tokenizer: BOS, then the UTF-8 bytes of the text. It has no chat template."""

    max_chars_per_token = 1  # a token per byte, and a character is one byte or more

    def encode(self, text: str) -> list[int]:
        return [demo.BOS_ID, *demo.encode(text)]

    def decode(self, token_ids: Sequence[int]) -> str:
        return demo.decode(list(token_ids))

    def encode_chat(self, messages: Sequence[Mapping[str, str]], max_chars: int | None = None) -> list[int]:
        raise ValueError("the demo model has no chat template: use /v1/completions with a prompt like 'lora='")


def as_tokenizer(tokenizer) -> Tokenizer:
    """``tokenizer`` as the engine uses it: transformers tokenizers are wrapped, anything else is taken as is."""
    from transformers import PreTrainedTokenizerBase

    return HFTokenizer(tokenizer) if isinstance(tokenizer, PreTrainedTokenizerBase) else tokenizer


# Steps of a fast tokenizer's pipeline (its tokenizer.json) after which every character of the text is still there
# to be covered by some token: none is deleted (as Whitespace deletes spaces, or NFC joins two into one).
_KEEPING_NORMALIZERS = {"Prepend", "Lowercase"}  # Prepend adds; lowercasing never shortens a character
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"}  # unless behavior "Removed"


def _max_chars_per_token(tokenizer) -> int | None:
    """The most characters of text one token of ``tokenizer`` can stand for, or None where it is unbounded or not
    known. Only a fast tokenizer of a BPE model whose pipeline keeps every character has the bound.

    Why it is safe: after such a pipeline every character of the text is covered by exactly one token, whether an
    added token (matched in the text as its content), a vocabulary entry, an unknown-token standing for one
    character (BPE without ``fuse_unk``), a byte-fallback token (one byte of a character), or a byte-level token
    (one character of its string per byte, and a text character has one byte or more). Each token's string is at
    least as long as the text it covers (markers like '##' only lengthen it), so a text of C characters has at
    least C / (longest token string) tokens: a longer text than ``max tokens * longest`` cannot fit.
    Unknown-tokens that swallow a whole word (WordLevel, WordPiece, Unigram, ``fuse_unk``) or added tokens that
    swallow the whitespace around them (``lstrip``/``rstrip``) have no bound.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    config = json.loads(backend.to_str())
    model = config["model"]
    if model.get("type") != "BPE" or model.get("fuse_unk") or not _keeps_every_character(config):
        return None
    if not (model.get("unk_token") is not None or _covers_every_byte(config)):
        return None  # a character outside the vocabulary would be dropped
    added = config.get("added_tokens") or []
    if any(token.get("lstrip") or token.get("rstrip") for token in added):
        return None
    strings = [*model["vocab"], *(token["content"] for token in added)]
    return max(map(len, strings), default=1)


def _covers_every_byte(config: dict) -> bool:
    """A vocabulary with a token for every byte, that a character outside it falls back to: byte-level BPE with
    every byte's character (GPT-2), or BPE with ``byte_fallback`` and every ``<0xNN>`` token (Llama 2)."""
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = config["model"]["vocab"]
    byte_level = any(step["type"] == "ByteLevel" for step in _steps(config.get("pre_tokenizer"), "pretokenizers"))
    if byte_level and all(char in vocab for char in ByteLevel.alphabet()):
        return True
    return bool(config["model"].get("byte_fallback")) and all(f"<0x{byte:02X}>" in vocab for byte in range(256))


def _keeps_every_character(config: dict) -> bool:
    return all(map(_normalizer_keeps, _steps(config.get("normalizer"), "normalizers"))) and all(
        step["type"] in _KEEPING_PRE_TOKENIZERS and step.get("behavior") != "Removed"
        for step in _steps(config.get("pre_tokenizer"), "pretokenizers")
    )


def _normalizer_keeps(step: dict) -> bool:
    """True for a normalizer that never makes a text shorter: those above, and a Replace of a plain string by one
    at least as long (Llama 2's ' ' -> '▁')."""
    if step["type"] == "Replace":
        pattern = step.get("pattern", {}).get("String")
        return bool(pattern) and len(step.get("content", "")) >= len(pattern)
    return step["type"] in _KEEPING_NORMALIZERS


def _steps(step: dict | None, sequence_key: str) -> list[dict]:
    """A normalizer's or pre-tokenizer's steps, a Sequence's unrolled."""
    if step is None:
        return []
    if step.get("type") == "Sequence":
        return [leaf for inner in step.get(sequence_key, []) for leaf in _steps(inner, sequence_key)]
    return [step]


class TextStream:
    """One request's text, built piece by piece as its tokens arrive, cut at the first of its stop strings.

    Decoding is incremental (each call decodes a few tokens, not the whole answer): the tokens since the last
    emitted piece are decoded together with the tokens before them, and the new text is the difference; a piece
    that ends in an incomplete UTF-8 sequence waits for the next token. Text that could be the beginning of a
    stop string is held back until the next tokens show it is not (so a stop string is never streamed in part).
    The text ends before the stop string that is complete first (the longest, when two end at the same character).

    Stop strings are searched for incrementally: each new character costs a constant time per stop string
    (amortized), whatever the length of the text or of the stop strings, so a client's long stop string cannot slow
    the engine down for everyone.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop_matchers = [_StopMatcher(stop_string) for stop_string in stop]
        self._tokens: list[int] = []
        self._prefix_offset = 0  # tokens[prefix:read] were decoded already; they give the next piece its context
        self._read_offset = 0
        self._handed_out: list[str] = []  # the pieces handed out, joined only when the whole text is asked for
        self._held = ""  # text after them that could be the beginning of a stop string
        self.stopped = False  # a stop string appeared: nothing is added after it
        self.abandoned = False  # its tokenizer failed: nothing more is decoded

    @property
    def text(self) -> str:
        """The text so far (cut before the stop string once one appeared)."""
        return "".join(self._handed_out) + self._held

    def add(self, token_ids: Sequence[int]) -> str:
        """Take the next tokens; return the text that can be handed out now (possibly "")."""
        if self.stopped or self.abandoned or not token_ids:
            return ""
        self._tokens.extend(token_ids)
        return self._take_new_text(last=False)

    def finish(self) -> str:
        """The rest of the text: call once the request has ended. The last tokens' text is taken even where it
        ends in U+FFFD (a real one, or a character cut short by the token limit, as ``decode`` gives it), then the
        text held back."""
        tail = "" if self.stopped or self.abandoned else self._take_new_text(last=True)
        return tail + self._hand_out(self._held, held="")

    def _take_new_text(self, last: bool) -> str:
        """Decode the tokens since the last piece; return what can be handed out now (the rest is held)."""
        seen = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        current = self._decode(self._tokens[self._prefix_offset :])
        if len(current) <= len(seen) or (current.endswith(REPLACEMENT_CHARACTER) and not last):
            return ""
        new_text = current[len(seen) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        pending = self._held + new_text
        stop_start = self._stop_start(new_text, len(self._held))
        if stop_start is not None:
            self.stopped = True
            return self._hand_out(pending[:stop_start], held="")
        # a stop string's beginning at the end of the text is at most the held text and the new text: it fits
        partial_stop = max((matcher.matched for matcher in self._stop_matchers), default=0)
        return self._hand_out(pending[: len(pending) - partial_stop], held=pending[len(pending) - partial_stop :])

    def _stop_start(self, new_text: str, held_length: int) -> int | None:
        """Feed ``new_text`` to the stop matchers: where the first complete stop string starts in the held text
        followed by ``new_text`` (it cannot start earlier: its beginning would have been held), or None."""
        if not self._stop_matchers:
            return None
        for index, char in enumerate(new_text):
            complete = [len(matcher.stop) for matcher in self._stop_matchers if matcher.feed(char)]
            if complete:
                return held_length + index + 1 - max(complete)
        return None

    def _hand_out(self, piece: str, held: str) -> str:
        if piece:
            self._handed_out.append(piece)
        self._held = held
        return piece


class _StopMatcher:
    """Finds one stop string in a text fed a character at a time (Knuth-Morris-Pratt).

    ``matched`` is the length of the longest end of the text so far that is a beginning of the stop string. Its
    fallback table (the longest proper border of each beginning of the stop string) is built only as far as
    ``matched`` has reached, so the work is linear in the text fed, however long the stop string is.
    """

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.matched = 0
        self._fallback = [0]  # _fallback[i]: length of the longest proper border of stop[: i + 1]

    def feed(self, char: str) -> bool:
        """Take the next character of the text; True when the text now ends with the whole stop string."""
        matched = self.matched
        while matched and self.stop[matched] != char:
            matched = self._border(matched - 1)
        if self.stop[matched] == char:
            matched += 1
        self.matched = matched
        return matched == len(self.stop)

    def _border(self, end: int) -> int:
        """The longest proper border of ``stop[: end + 1]``, extending the table up to ``end`` if needed."""
        stop, fallback = self.stop, self._fallback
        while len(fallback) <= end:
            index, border = len(fallback), fallback[-1]
            while border and stop[index] != stop[border]:
                border = fallback[border - 1]
            fallback.append(border + 1 if stop[index] == stop[border] else border)
        return fallback[end]
