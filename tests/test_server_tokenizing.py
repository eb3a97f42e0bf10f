"""Text prompts through a real Hugging Face tokenizer (a byte-level BPE trained here, offline) in a real
``punica-hf serve`` process: a huge prompt is refused before it is tokenized and tokenizing never holds up other
clients; text that is not valid Unicode is a 400; an unexpected error is a 500 in OpenAI's error JSON.
"""

import asyncio
import json
import random
import statistics
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from helpers import tiny_llama
from server_process import Server
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from punica_hf import MultiLoraModel, demo
from punica_hf.serving import Engine
from punica_hf.serving.app import create_app
from punica_hf.serving.text import HFTokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog", "multi tenant lora serving with punica", "hello world"]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
MAX_MODEL_LEN = 256
HUGE_PROMPT_CHARS = 4 * 1024 * 1024 - 1024  # just under the server's default body limit
SLOWER_THAN_ALONE_AT_MOST = 0.5  # seconds
HUGE_PROMPTS = 4
SMALL = {"model": "tiny", "prompt": "hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def byte_level_bpe() -> PreTrainedTokenizerFast:
    """A GPT-2-style tokenizer: byte-level BPE with every byte in its vocabulary, BOS added, a chat template."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS * 20, trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def sentencepiece_style_bpe() -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: '▁' for spaces (a normalizer), BPE with byte fallback, no pre-tokenizer."""
    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    byte_tokens = [f"<0x{byte:02X}>" for byte in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens])
    backend.train_from_iterator([text.replace(" ", "▁") for text in CORPUS] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_bpe()


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("bpe_model")
    base = tiny_llama(vocab_size=len(tokenizer), max_position_embeddings=MAX_MODEL_LEN, bos_token_id=0,
                      eos_token_id=1, pad_token_id=1)
    base.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    process = Server(["--model", str(folder / "model"), "--served-model-name", "tiny"], folder / "server.log")
    yield process
    process.stop()


@pytest.mark.parametrize("make", [byte_level_bpe, sentencepiece_style_bpe])
def test_every_token_stands_for_at_most_max_chars_per_token(make):
    """The bound the server refuses long prompts by: no text has fewer tokens than its characters divided by
    ``max_chars_per_token``, however its characters are drawn (words of the corpus, spaces, emoji, specials)."""
    tokenizer = make()
    per_token = HFTokenizer(tokenizer).max_chars_per_token
    longest = max(tokenizer.get_vocab(), key=len)
    assert per_token == len(longest)
    pieces = [*" ".join(CORPUS).split(), " ", "  ", "\n", "é", "😀", "<s>", "</s>", tokenizer.decode([0, 5, 9])]
    pieces.append(tokenizer.convert_tokens_to_string([longest]))
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 40)))
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) * per_token >= len(text), text


def test_tokenizers_without_a_bound_say_so():
    """A word-level tokenizer maps a whole unknown word of any length to one token; a Whitespace pre-tokenizer
    deletes spaces; NFC joins characters: texts of any length can then have few tokens, so no character bound."""
    word_level = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    assert len(word_level.encode("x" * 10_000).ids) == 1 and not word_level.encode(" " * 10_000).ids
    dropping_spaces = byte_level_bpe().backend_tokenizer
    dropping_spaces.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.ByteLevel()])
    joining = byte_level_bpe().backend_tokenizer
    joining.normalizer = normalizers.NFC()
    for backend in (word_level, dropping_spaces, joining):
        assert HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=backend)).max_chars_per_token is None


def test_a_prompt_that_fits_exactly_is_served(server, tokenizer):
    """The longest vocabulary entry repeated to the prompt's whole token budget: as many characters per token as
    any text can have, and still not refused by the character bound."""
    longest = tokenizer.convert_tokens_to_string([max(tokenizer.get_vocab(), key=len)])
    max_tokens = 4
    prompt = longest * (MAX_MODEL_LEN - max_tokens - 1)  # BOS is the last token of the budget
    assert len(tokenizer(prompt)["input_ids"]) == MAX_MODEL_LEN - max_tokens
    body = {**SMALL, "prompt": prompt, "max_tokens": max_tokens}
    response = httpx.post(f"{server.url}/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN - max_tokens
    too_long = httpx.post(f"{server.url}/completions", json={**body, "prompt": prompt + longest}, timeout=60)
    assert too_long.status_code == 400 and "exceeds the 256-token limit" in too_long.json()["error"]["message"]


def test_huge_prompts_do_not_hold_up_other_clients(server):
    """Four prompts of nearly 4 MB (under the body limit) sent with small requests: the huge ones get a 400 at
    once, and each small request finishes within 0.5 s of its time alone."""

    async def timed(client: httpx.AsyncClient, body: dict) -> tuple[float, httpx.Response]:
        start = time.perf_counter()
        response = await client.post(f"{server.url}/completions", json=body)
        return time.perf_counter() - start, response

    async def run() -> tuple[float, list, list]:
        async with httpx.AsyncClient(timeout=60) as client:
            alone = statistics.median([(await timed(client, SMALL))[0] for _ in range(3)])
            huge = {**SMALL, "prompt": "the quick brown fox " * (HUGE_PROMPT_CHARS // 20)}
            huge_tasks = [asyncio.create_task(timed(client, huge)) for _ in range(HUGE_PROMPTS)]
            await asyncio.sleep(0.3)  # the huge bodies are in: their tokenizing would have begun
            small = await asyncio.gather(*(timed(client, SMALL) for _ in range(3)))
            return alone, small, await asyncio.gather(*huge_tasks)

    alone, small, huge = asyncio.run(run())
    for _, response in huge:
        assert response.status_code == 400 and "exceeds the 256-token limit" in response.json()["error"]["message"]
    for seconds, response in small:
        assert response.status_code == 200, response.text
        assert seconds < alone + SLOWER_THAN_ALONE_AT_MOST, (seconds, alone)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_lone_surrogate_is_a_400(server, route):
    """``\\ud800`` is valid JSON but not Unicode text: a tokenizer cannot take it."""
    if route == "completions":
        body = '{"model": "tiny", "prompt": "hello \\ud800 world", "max_tokens": 2}'
        param = "prompt"
    else:
        body = '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi \\ud800"}]}'
        param = "messages.0.content"
    url = f"{server.url}/{'chat/completions' if route == 'chat' else 'completions'}"
    response = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "surrogate" in error["message"] and error["param"] == param
    assert "Traceback" not in server.log_text()


class _FailingTokenizer:
    """A tokenizer with a bug: every text fails with an error no route expects."""

    def encode(self, text):
        raise RuntimeError("secret internals /srv/private")

    def decode(self, token_ids):
        return ""

    def encode_chat(self, messages, max_chars=None):
        raise RuntimeError("secret internals /srv/private")


def test_an_unexpected_error_is_a_500_in_openai_error_json():
    engine = Engine(MultiLoraModel(demo.load_base_model(), max_adapters=1), _FailingTokenizer())
    with TestClient(create_app(engine, "demo"), raise_server_exceptions=False) as client:
        for route, body in [
            ("/v1/completions", {"model": "demo", "prompt": "lora="}),
            ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}),
        ]:
            response = client.post(route, json=body)
            assert response.status_code == 500
            error = response.json()["error"]
            assert error["type"] == "server_error" and "secret" not in json.dumps(error)
