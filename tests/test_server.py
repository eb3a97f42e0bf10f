"""``punica-hf serve`` as a real server process on a free port, driven by the ``openai`` client and raw HTTP.

Two servers run for the whole module: the demo model with its adapters (API key, runtime adapter loading on),
and a tiny random Llama with a word-level tokenizer that has a chat template (long generations, for cancelling).
Every answer is compared with offline greedy ``generate()`` in this process. A third server checks that SIGTERM
lets a running request finish before the process exits.
"""

import asyncio
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from helpers import save_peft_adapter, tiny_llama
from server_process import Server, child_env, start_demo_server, wait_until
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from punica_hf import MultiLoraModel, demo

API_KEY = "test-key"
WORDS = demo.sample_words(2, seed=11, held_out=True)
DEMO_ADAPTERS = [*demo.TASKS, None]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}assistant :"


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def demo_answers():
    """Offline greedy answers of the demo model, per adapter and word."""
    model = MultiLoraModel(demo.load_base_model(), max_adapters=3)
    model.load_adapters(demo.adapter_paths())
    return {
        adapter: dict(zip(WORDS, demo.generate_answers(model, WORDS, adapter_ids=[adapter] * len(WORDS))))
        for adapter in DEMO_ADAPTERS
    }


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory) -> Path:
    """An allowed --lora-dir holding a copy of the demo's sort adapter, and a symlink that leads out of it."""
    folder = tmp_path_factory.mktemp("lora_dir")
    shutil.copytree(demo.adapter_paths()["sort"], folder / "sort_copy")
    (folder / "escape").symlink_to(demo.adapter_paths()["upper"], target_is_directory=True)
    return folder


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory, lora_dir):
    server = start_demo_server(API_KEY, lora_dir, tmp_path_factory.mktemp("logs") / "demo_server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(demo_server):
    return openai.OpenAI(base_url=demo_server.url, api_key=API_KEY, max_retries=0, timeout=60)


def make_tiny_chat_model(folder: Path) -> tuple[Path, Path]:
    """A tiny random Llama with a word-level tokenizer that has a chat template, and a PEFT adapter for it."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "user": 3, "assistant": 4, "system": 5, ":": 6}
    vocab.update({f"w{i}": len(vocab) + i for i in range(93)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    base = tiny_llama(vocab_size=len(vocab), max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)
    model_dir, adapter_dir = folder / "model", folder / "adapter"
    base.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    save_peft_adapter(base, adapter_dir, seed=3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    return model_dir, adapter_dir


@pytest.fixture(scope="module")
def tiny_model_dirs(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, tiny_model_dirs):
    model_dir, adapter_dir = tiny_model_dirs
    server = Server(
        ["--model", str(model_dir), "--adapter", f"tiny={adapter_dir}", "--max-queue", "4", "--max-running", "2"],
        tmp_path_factory.mktemp("logs") / "tiny_server.log",
    )
    yield server
    server.stop()


# ---------------------------------------------------------------------- completions
def test_concurrent_requests_over_adapters_and_base_equal_offline_generate(demo_server, demo_answers):
    async def ask_all():
        client = openai.AsyncOpenAI(base_url=demo_server.url, api_key=API_KEY, max_retries=0, timeout=60)
        requests = [(adapter, word) for adapter in DEMO_ADAPTERS for word in WORDS]
        responses = await asyncio.gather(*(
            client.completions.create(
                model=adapter or "demo", prompt=demo.make_prompt(word), max_tokens=12, temperature=0
            )
            for adapter, word in requests
        ))
        await client.close()
        return requests, responses

    requests, responses = asyncio.run(ask_all())
    for (adapter, word), response in zip(requests, responses):
        choice = response.choices[0]
        assert (choice.text, choice.finish_reason) == (demo_answers[adapter][word], "stop"), (adapter, word)
        assert response.model == (adapter or "demo")
        assert response.usage.prompt_tokens == len(demo.make_prompt(word)) + 1  # BOS + bytes
        assert response.usage.completion_tokens == len(choice.text) + 1  # the answer + EOS
        assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_streaming_equals_non_streaming(client, demo_answers):
    for adapter in ("reverse", "sort"):
        stream = client.completions.create(
            model=adapter, prompt=demo.make_prompt(WORDS[0]), max_tokens=12, temperature=0, stream=True
        )
        chunks = list(stream)
        text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
        whole = client.completions.create(
            model=adapter, prompt=demo.make_prompt(WORDS[0]), max_tokens=12, temperature=0
        )
        assert text == whole.choices[0].text == demo_answers[adapter][WORDS[0]]
        finish = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
        assert finish == ["stop"]
        assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_several_prompts_give_one_choice_each(client, demo_answers):
    response = client.completions.create(
        model="upper", prompt=[demo.make_prompt(word) for word in WORDS], max_tokens=12, temperature=0
    )
    assert [c.index for c in response.choices] == list(range(len(WORDS)))
    assert [c.text for c in response.choices] == [demo_answers["upper"][word] for word in WORDS]


@pytest.mark.parametrize("choices", [1, 2])
def test_a_stream_whose_request_fails_to_read_raises_rather_than_waiting_forever(choices):
    """The pieces of one or several requests merged into one stream: a request whose pieces cannot be read (its
    iterator raises) fails the stream; with several, it used to leave the stream waiting for its end forever."""
    from punica_hf.serving.app import _merged
    from punica_hf.serving.types import Delta

    class Breaks:
        async def __aiter__(self):
            yield Delta((1,), "a")
            raise RuntimeError("the pieces cannot be read")

    class Fine:
        async def __aiter__(self):
            yield Delta((2,), "b", "stop")

    async def read():
        got = []
        async for piece in _merged([Breaks(), Fine()][:choices]):
            got.append(piece)
        return got

    with pytest.raises(RuntimeError, match="the pieces cannot be read"):
        asyncio.run(asyncio.wait_for(read(), timeout=10))


def test_several_prompts_stream_one_choice_each(client, demo_answers):
    """The choices' pieces come interleaved as they are made; each index's pieces add up to its answer."""
    stream = client.completions.create(
        model="upper", prompt=[demo.make_prompt(word) for word in WORDS], max_tokens=12, temperature=0, stream=True
    )
    texts, finishes = {}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {index: demo_answers["upper"][word] for index, word in enumerate(WORDS)}
    assert finishes == {index: "stop" for index in range(len(WORDS))}


@pytest.mark.parametrize(
    ("options", "text", "finish_reason"),
    [
        (dict(stop="NI"), "PU", "stop"),
        (dict(stop=["zz", "CA"]), "PUNI", "stop"),
        (dict(max_tokens=3), "PUN", "length"),
        (dict(extra_body={"stop_token_ids": [ord("N")]}), "PU", "stop"),
    ],
)
def test_stop_strings_and_max_tokens(client, options, text, finish_reason):
    options = {"max_tokens": 12, **options}
    response = client.completions.create(model="upper", prompt="punica=", temperature=0, **options)
    assert (response.choices[0].text, response.choices[0].finish_reason) == (text, finish_reason)
    stream = client.completions.create(model="upper", prompt="punica=", temperature=0, stream=True, **options)
    assert "".join(c.text for chunk in stream for c in chunk.choices) == text


def test_seeded_sampling_repeats(client):
    def sample(seed):
        response = client.completions.create(
            model="reverse", prompt="adapter=", max_tokens=12, temperature=3.0, seed=seed
        )
        return response.choices[0].text

    assert sample(5) == sample(5)
    assert len({sample(seed) for seed in range(6)}) > 1


def test_models_lists_the_base_and_every_adapter_without_paths(demo_server, client):
    models = {card.id: card for card in client.models.list().data}
    assert set(models) == {"demo", *demo.TASKS}
    assert models["demo"].parent is None
    assert all(models[name].parent == "demo" for name in demo.TASKS)
    raw = httpx.get(f"{demo_server.url}/models", headers={"Authorization": f"Bearer {API_KEY}"}).text
    adapter_folder = str(demo.adapter_paths()["upper"].parent)
    assert adapter_folder not in raw and "root" not in raw  # where the weights lie is the operator's business


# ---------------------------------------------------------------------- runtime adapters
def test_runtime_load_and_unload(demo_server, client, lora_dir, demo_answers):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    load = httpx.post(f"{demo_server.url}/load_lora_adapter", headers=headers,
                      json={"lora_name": "sorter", "lora_path": str(lora_dir / "sort_copy")})
    assert load.status_code == 200 and "sorter" in load.text
    assert {c.id: c.parent for c in client.models.list().data}["sorter"] == "demo"
    response = client.completions.create(
        model="sorter", prompt=demo.make_prompt(WORDS[0]), max_tokens=12, temperature=0
    )
    assert response.choices[0].text == demo_answers["sort"][WORDS[0]]

    again = httpx.post(f"{demo_server.url}/load_lora_adapter", headers=headers,
                       json={"lora_name": "sorter", "lora_path": str(lora_dir / "sort_copy")})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]

    unload = httpx.post(f"{demo_server.url}/unload_lora_adapter", headers=headers, json={"lora_name": "sorter"})
    assert unload.status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sorter", prompt="lora=", max_tokens=4)
    gone = httpx.post(f"{demo_server.url}/unload_lora_adapter", headers=headers, json={"lora_name": "sorter"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "path",
    [
        "escape",  # a symlink inside the allowed directory that resolves outside it
        "sort_copy/../..",  # a path that climbs out
        "missing",  # inside, but not there
    ],
)
def test_runtime_load_only_from_allowed_directories(demo_server, lora_dir, path):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = httpx.post(f"{demo_server.url}/load_lora_adapter", headers=headers,
                          json={"lora_name": "outside", "lora_path": str(lora_dir / path)})
    assert response.status_code == 400 and response.json()["error"]["param"] == "lora_path"
    assert "outside" not in {c["id"] for c in httpx.get(f"{demo_server.url}/models", headers=headers).json()["data"]}


def test_runtime_loading_is_off_unless_enabled(tiny_server):
    response = httpx.post(f"{tiny_server.url}/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
    assert response.status_code == 404 and "error" in response.json()


# ---------------------------------------------------------------------- auth and errors
@pytest.mark.parametrize(
    ("args", "exit_code", "message"),
    [
        (["--allow-runtime-lora"], 1, "needs at least one --lora-dir"),
        (["--lora-dir", "."], 1, "only used with --allow-runtime-lora"),
        (["--allow-runtime-lora", "--lora-dir", "/no/such/dir"], 1, "not a directory"),
        (["--adapter", "demo=./a"], 1, "the adapter name 'demo' is the base model's served name"),
        (["--served-model-name", "upper"], 1, "the adapter name 'upper' is the base model's served name"),
        (["--adapter", "a=./a", "--adapter", "a=./b"], 2, "the name 'a' is given twice"),
        (["--api-key", ""], 1, "--api-key: the API key must be a non-empty string without whitespace at its ends"),
    ],
)
def test_serve_refuses_bad_options_before_loading_anything(capsys, monkeypatch, args, exit_code, message):
    from punica_hf.cli import main, serve

    monkeypatch.setattr(serve, "load_model", _must_not_load)
    assert main(["serve", "--model", "demo", "--port", "0", *args]) == exit_code
    assert message in capsys.readouterr().err


def test_serve_refuses_a_busy_address_before_loading_the_model(capsys, monkeypatch):
    from punica_hf.cli import main, serve

    monkeypatch.setattr(serve, "load_model", _must_not_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "demo", "--port", str(port), "--device", "cpu"]) == 1
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err


def _must_not_load(*args, **kwargs):
    raise AssertionError("the model was loaded before the options and the address were checked")


def test_serve_on_port_0_says_the_port_the_system_chose(tmp_path):
    """``--port 0`` (any free port) printed ``http://127.0.0.1:0/v1``: the address nobody could reach."""
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "punica_hf", "serve", "--model", "demo", "--port", "0", "--device", "cpu"]
    with open(log, "w") as output:
        env = {**child_env(), "COLUMNS": "200"}  # the line unwrapped
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
    try:
        wait_until(lambda: "/v1" in log.read_text() or process.poll() is not None, 120)
        ports = re.findall(r"on http://127\.0\.0\.1:(\d+)/v1", log.read_text())
        assert ports and ports[0] != "0", log.read_text()
        assert httpx.get(f"http://127.0.0.1:{ports[0]}/health", timeout=30).status_code == 200
    finally:
        process.terminate()
        process.wait(60)


def test_api_key_is_required_everywhere_but_health(demo_server):
    calls = [
        ("GET", "/v1/models", None),
        ("GET", "/metrics", None),
        ("POST", "/v1/completions", {"model": "demo", "prompt": "lora=", "max_tokens": 2}),
        ("POST", "/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "upper"}),
        ("GET", "/openapi.json", None),
    ]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path, body in calls:
            response = httpx.request(method, demo_server.base + path, json=body, headers=headers)
            assert response.status_code == 401, (method, path, headers)
            assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{demo_server.base}/health").status_code == 200
    for docs_page in ("/docs", "/redoc"):  # a browser page cannot send the key: off when there is one
        assert httpx.get(demo_server.base + docs_page).status_code == 401
        keyed = httpx.get(demo_server.base + docs_page, headers={"Authorization": f"Bearer {API_KEY}"})
        assert keyed.status_code == 404
    schema = httpx.get(f"{demo_server.base}/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"})
    assert "/v1/completions" in schema.json()["paths"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=demo_server.url, api_key="wrong", max_retries=0).models.list()
    assert "upper" in {c["id"] for c in httpx.get(f"{demo_server.url}/models",
                                                   headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"]}


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"model": "nope", "prompt": "lora="}, 404, "does not exist"),
        ({"model": "upper", "prompt": "x" * 60, "max_tokens": 10}, 400, "exceeds the 64-token limit"),
        ({"model": "upper"}, 400, "prompt"),
        ({"model": "upper", "prompt": "lora=", "n": 2}, 400, "not supported by this server: n"),
        ({"model": "upper", "prompt": "lora=", "temperature": -1}, 400, "temperature"),
        ({"model": "upper", "prompt": "lora=", "temperature": 1e-300}, 400, "temperature must be 0 (greedy) or"),
        ({"model": "upper", "prompt": "lora=", "seed": 2**70}, 400, "seed must be an integer from"),
        ({"model": "upper", "prompt": "lora=", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "upper", "prompt": [1, 999]}, 400, "integers in [0, 259)"),
        ({"model": "upper", "prompt": []}, 400, "empty"),
    ],
)
def test_errors_are_openai_error_json(demo_server, body, status, message):
    response = httpx.post(f"{demo_server.url}/completions", json=body,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and error["type"]


def test_malformed_json_and_chat_without_template_are_400(demo_server):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    broken = httpx.post(f"{demo_server.url}/completions", content=b"{not json", headers=headers)
    assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]
    chat = httpx.post(f"{demo_server.url}/chat/completions", headers=headers,
                      json={"model": "upper", "messages": [{"role": "user", "content": "lora"}]})
    assert chat.status_code == 400 and "no chat template" in chat.json()["error"]["message"]


def test_full_queue_answers_429(tiny_server):
    async def burst():
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=60) as http:
            body = {"model": "tiny", "prompt": [1, 7, 8], "max_tokens": 300, "ignore_eos": True, "temperature": 0}
            return await asyncio.gather(*(http.post("/completions", json=body) for _ in range(12)))

    responses = asyncio.run(burst())
    statuses = [response.status_code for response in responses]
    assert set(statuses) == {200, 429}
    rejected = next(r for r in responses if r.status_code == 429).json()["error"]
    assert rejected["code"] == "queue_full"
    assert all(r.json()["usage"]["completion_tokens"] == 300 for r in responses if r.status_code == 200)
    assert tiny_server.metrics()["punica_requests_rejected_total"] >= statuses.count(429)


# ---------------------------------------------------------------------- chat (tiny model with a template)
def test_chat_completions_equal_offline_generate(tiny_server, tiny_model_dirs):
    model_dir, adapter_dir = tiny_model_dirs
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = MultiLoraModel(AutoModelForCausalLM.from_pretrained(model_dir).eval(), max_adapters=1)
    model.load_adapters({"tiny": adapter_dir})
    client = openai.OpenAI(base_url=tiny_server.url, api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w5 w9 w13"}]
    for adapter in ("tiny", None):
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        prompt = prompt["input_ids"] if not isinstance(prompt, torch.Tensor) else prompt
        output = model.generate(prompt, adapter_ids=[adapter], max_new_tokens=16, do_sample=False, pad_token_id=0)
        expected = tokenizer.decode(output[0, prompt.shape[1]:], skip_special_tokens=True)
        name = adapter or str(model_dir)
        response = client.chat.completions.create(model=name, messages=messages, max_tokens=16, temperature=0)
        assert response.choices[0].message.content == expected and response.choices[0].message.role == "assistant"
        assert response.usage.prompt_tokens == prompt.shape[1]
        stream = client.chat.completions.create(model=name, messages=messages, max_tokens=16, temperature=0,
                                                stream=True)
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.total_tokens > 0


# ---------------------------------------------------------------------- disconnects, metrics, SIGTERM
def test_client_disconnects_cancel_quietly_and_free_kv(tiny_server):
    """Streaming and non-streaming clients, of one prompt and of two, that go away mid-answer: their requests are
    cancelled and freed, and the server logs no traceback."""
    before = tiny_server.metrics()
    one_prompt = {"model": "tiny", "prompt": [1, 9, 4, 12], "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    two_prompts = {**one_prompt, "prompt": [[1, 9, 4, 12], [1, 5, 6]]}
    for body in (one_prompt, two_prompts):
        streamed = {**body, "stream": True}
        with httpx.stream("POST", f"{tiny_server.url}/completions", json=streamed, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming request whose client gives up
            httpx.post(f"{tiny_server.url}/completions", json=body, timeout=1.0)
    dropped = 2 * (1 + 2)

    def all_dropped():
        name = "punica_requests_dropped_and_freed_total"
        return tiny_server.metrics()[name] - before[name] == dropped

    wait_until(all_dropped)
    after = tiny_server.metrics()
    cancelled = 'punica_requests_total{finish_reason="cancelled"}'
    assert after[cancelled] - before[cancelled] == dropped
    assert after["punica_running_requests"] == 0 and after["punica_kv_cache_free_fraction"] == 1.0
    assert after["punica_generation_tokens_total"] - before["punica_generation_tokens_total"] < dropped * 3000
    log = tiny_server.log_text()
    assert "Traceback" not in log and "never retrieved" not in log, log


def test_metrics_count_requests_tokens_and_latencies(demo_server, client):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    before = demo_server.metrics(headers)
    response = client.completions.create(model="reverse", prompt="metrics=", max_tokens=12, temperature=0)
    after = demo_server.metrics(headers)
    delta = {name: after[name] - before.get(name, 0) for name in after}
    assert delta['punica_requests_total{finish_reason="stop"}'] == 1
    assert delta["punica_prompt_tokens_total"] == response.usage.prompt_tokens
    assert delta["punica_generation_tokens_total"] == response.usage.completion_tokens
    assert delta["punica_time_to_first_token_seconds_count"] == 1
    assert delta["punica_request_latency_seconds_count"] == 1
    assert 1 <= delta["punica_time_per_output_token_seconds_count"] <= response.usage.completion_tokens - 1
    assert after["punica_adapter_registered"] == len(demo.TASKS)
    assert after["punica_queue_length"] == 0 and after["punica_running_requests"] == 0
    assert after['punica_attention_path{path="punica_hf paged attention (PyTorch ops)"}'] == 1  # the CPU's path
    for name in ("punica_adapter_evictions_total", "punica_batch_requests", "punica_kv_cache_free_fraction"):
        assert name in after


def test_sigterm_finishes_running_requests_then_exits(tmp_path, tiny_model_dirs):
    model_dir, adapter_dir = tiny_model_dirs
    server = Server(["--model", str(model_dir), "--adapter", f"tiny={adapter_dir}"], tmp_path / "server.log")
    try:
        body = {"model": "tiny", "prompt": [1, 5, 6], "max_tokens": 400, "ignore_eos": True, "temperature": 0,
                "stream": True}
        # a request whose body is still on its way when the signal comes: taken already, so it is answered
        late = json.dumps({**body, "stream": False, "max_tokens": 5}).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as late_client, \
                httpx.stream("POST", f"{server.url}/completions", json=body, timeout=60) as stream:
            late_client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: server\r\nContent-Type: application/json"
                                b"\r\nContent-Length: %d\r\n\r\n" % len(late) + late[:10])
            events = (line[len("data: "):] for line in stream.iter_lines() if line.startswith("data: "))
            first = json.loads(next(events))
            server.process.send_signal(signal.SIGTERM)
            time.sleep(1)  # the server is shutting down
            late_client.sendall(late[10:])
            rest = list(events)
            late_answer = b"".join(iter(lambda: late_client.recv(65536), b""))
        assert first["choices"][0]["finish_reason"] is None
        assert rest[-1] == "[DONE]"
        usage = json.loads(rest[-2])["usage"]
        finish = [c["finish_reason"] for event in rest[:-1] for c in json.loads(event)["choices"] if c["finish_reason"]]
        assert usage["completion_tokens"] == 400 and finish == ["length"]
        head, _, late_body = late_answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), late_answer[:500]
        assert json.loads(late_body)["usage"]["completion_tokens"] == 5
        assert server.process.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    finally:
        server.stop()


def test_sigterm_with_a_drain_bound_answers_what_it_could_not_finish_with_503s_and_exits_in_time(
        tmp_path, tiny_model_dirs):
    """``--drain-seconds 1``: after SIGTERM the requests in flight (running and queued, streamed and not) that cannot
    finish within the bound get an answer that says so (a 503 ``shut_down``; a stream: its tokens so far, an error
    event, then ``[DONE]``), and the command exits soon after the bound, not when they would have finished."""
    model_dir, adapter_dir = tiny_model_dirs
    server = Server(["--model", str(model_dir), "--adapter", f"tiny={adapter_dir}", "--max-running", "1",
                     "--drain-seconds", "1"], tmp_path / "server.log")
    try:
        body = {"model": "tiny", "prompt": [1, 5, 6], "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
        with ThreadPoolExecutor(3) as pool, \
                httpx.stream("POST", f"{server.url}/completions", json={**body, "stream": True}, timeout=60) as stream:
            events = (line[len("data: "):] for line in stream.iter_lines() if line.startswith("data: "))
            first = json.loads(next(events))
            waiting = [pool.submit(httpx.post, f"{server.url}/completions", json=body, timeout=60) for _ in range(3)]
            wait_until(lambda: server.metrics()["punica_queue_length"] == 3)
            server.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            rest = list(events)
            answers = [future.result() for future in waiting]
        assert first["choices"][0]["finish_reason"] is None
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["error"]["code"] == "shut_down", rest[-3:]
        assert all(json.loads(event)["choices"][0]["finish_reason"] is None for event in rest[:-2])
        assert [(a.status_code, a.json()["error"]["code"]) for a in answers] == [(503, "shut_down")] * 3
        assert "time it gives the requests in flight ran out" in answers[0].json()["error"]["message"]
        assert server.process.wait(timeout=60) in (0, -signal.SIGTERM)
        assert time.monotonic() - signalled < 20, "the command outlived its drain by far"
        assert "Traceback" not in server.log_text()
    finally:
        server.stop()
