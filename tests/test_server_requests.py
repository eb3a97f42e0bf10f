"""Request bodies and headers a ``punica-hf serve --model demo`` process must refuse or take exactly: OpenAI's types
strictly (with the field named in ``param``), the Authorization scheme in any case, adapter names by the rules of a
Hub repo id, paths with a NUL byte; and concurrent load/unload/complete churn answered without a 500. API keys of
any characters, and load errors that show the client's path only, are checked on the app in this process.
"""

import random
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient
from server_process import start_demo_server

from punica_hf import MultiLoraModel, demo
from punica_hf.serving import DemoTokenizer, Engine, EngineConfig
from punica_hf.serving.app import create_app

API_KEY = "requests-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHURN_THREADS = 8
CHURN_OPERATIONS = 600
CHURN_NAMES = ("churn-a", "churn-b")


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("requests_lora_dir")
    shutil.copytree(demo.adapter_paths()["sort"], folder / "sort_copy")
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory, lora_dir):
    process = start_demo_server(API_KEY, lora_dir, tmp_path_factory.mktemp("logs") / "requests_server.log")
    yield process
    process.stop()


def test_the_server_says_how_big_its_host_tier_is(server):
    """One line at start: the CPU memory that holds adapters not on the device (``--max-adapters`` beyond)."""
    sizes = re.findall(r"adapter host tier: ([\d.]+) GiB \((\d+) bytes\)", server.log_text())
    assert len(sizes) == 1, server.log_text()
    gib, size = sizes[0]
    assert int(size) > 0 and float(gib) == round(int(size) / 2**30, 1)


def post(server, route: str, body, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{server.url}/{route}", json=body, headers=headers, timeout=60)


COMPLETION = {"model": "upper", "prompt": "lora=", "max_tokens": 4, "temperature": 0}
CHAT = {"model": "upper", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("completions", {**COMPLETION, "temperature": "0.5"}, "temperature"),
        ("completions", {**COMPLETION, "top_p": "1"}, "top_p"),
        ("completions", {**COMPLETION, "max_tokens": "4"}, "max_tokens"),
        ("completions", {**COMPLETION, "max_tokens": 4.0}, "max_tokens"),
        ("completions", {**COMPLETION, "stream": "yes"}, "stream"),
        ("completions", {**COMPLETION, "stream": 1}, "stream"),
        ("completions", {**COMPLETION, "prompt": [True, False]}, "prompt"),
        ("completions", {**COMPLETION, "prompt": [[1, True]]}, "prompt"),
        ("completions", {**COMPLETION, "prompt": 5}, "prompt"),
        ("completions", {**COMPLETION, "stop": 5}, "stop"),
        ("completions", {**COMPLETION, "model": 5}, "model"),
        ("completions", {**COMPLETION, "stop_token_ids": ["1"]}, "stop_token_ids.0"),
        ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         "messages.0.content"),
        ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ("chat/completions", {**CHAT, "temperature": "0"}, "temperature"),
    ],
)
def test_types_follow_openai_strictly(server, route, body, param):
    response = post(server, route, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_json_numbers_of_either_kind_are_numbers(server):
    """An integer where a float is expected is still a number (JSON has one number type)."""
    assert post(server, "completions", {**COMPLETION, "temperature": 0, "top_p": 1}).status_code == 200


def test_the_authorization_scheme_is_case_insensitive(server):
    for scheme in ("bearer", "BEARER", "Bearer", "bEaReR"):
        headers = {"Authorization": f"{scheme} {API_KEY}"}
        assert httpx.get(f"{server.url}/models", headers=headers).status_code == 200, scheme
    for wrong in (f"Basic {API_KEY}", f"bearer {API_KEY}x", "bearer", API_KEY, f"Bearer{API_KEY}"):
        assert httpx.get(f"{server.url}/models", headers={"Authorization": wrong}).status_code == 401, wrong


@pytest.mark.parametrize(
    "name",
    ["bad\x00name", "x" * 100_000, "emoji-😀", "a/b/c", "-lead", "trail.", "two--dashes", "dots..two", "", " "],
)
def test_runtime_adapter_names_follow_hub_repo_id_rules(server, lora_dir, name):
    response = post(server, "load_lora_adapter", {"lora_name": name, "lora_path": str(lora_dir / "sort_copy")})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "lora_name" and len(error["message"]) < 1000
    assert name not in {card["id"] for card in httpx.get(f"{server.url}/models", headers=AUTH).json()["data"]}


def test_a_hub_style_adapter_name_loads(server, lora_dir):
    name = "org_1/sort-copy.v2"
    response = post(server, "load_lora_adapter", {"lora_name": name, "lora_path": str(lora_dir / "sort_copy")})
    assert response.status_code == 200, response.text
    assert post(server, "completions", {**COMPLETION, "model": name}).status_code == 200
    assert post(server, "unload_lora_adapter", {"lora_name": name}).status_code == 200


def test_a_nul_byte_in_lora_path_is_a_400(server, lora_dir):
    response = post(server, "load_lora_adapter", {"lora_name": "nul", "lora_path": f"{lora_dir}/sort\x00copy"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "lora_path"


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("completions", '{"model": "up\\ud800", "prompt": "lora="}', "model"),
        ("completions", '{"model": "upper", "prompt": "lora=", "user": "\\udfff"}', "user"),
        ("unload_lora_adapter", '{"lora_name": "x\\ud800"}', "lora_name"),
        ("load_lora_adapter", '{"lora_name": "x", "lora_path": "/tmp/\\ud800"}', "lora_path"),
    ],
)
def test_a_lone_surrogate_anywhere_is_a_400(server, route, body, param):
    """Text that cannot be encoded would fail the answer that echoes it back: refused up front."""
    response = httpx.post(f"{server.url}/{route}", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_load_unload_complete_churn_never_answers_500(server, lora_dir):
    """Threads load, unload and use the same two names at once: every answer is a success or a 400 / 404 about
    that name alone, never a 500, and the server logs no traceback."""
    path = str(lora_dir / "sort_copy")
    others = list(demo.TASKS)  # loaded all along: no answer about a churned name should list them

    def operation(seed: int) -> tuple[str, int, str]:
        rng = random.Random(seed)
        name = rng.choice(CHURN_NAMES)
        kind = rng.choice(["load", "unload", "unload", "complete"])
        if kind == "load":
            response = post(server, "load_lora_adapter", {"lora_name": name, "lora_path": path})
        elif kind == "unload":
            response = post(server, "unload_lora_adapter", {"lora_name": name})
        else:
            response = post(server, "completions", {**COMPLETION, "model": name, "max_tokens": 2})
        return kind, response.status_code, response.text

    with ThreadPoolExecutor(CHURN_THREADS) as pool:
        answers = list(pool.map(operation, range(CHURN_OPERATIONS)))
    allowed = {"load": {200, 400}, "unload": {200, 404}, "complete": {200, 404}}
    wrong = [(kind, status, text[:200]) for kind, status, text in answers if status not in allowed[kind]]
    assert not wrong, wrong
    assert {status for kind, status, _ in answers if kind == "unload"} == {200, 404}  # the race was run
    leaked = [text for _, status, text in answers if status != 200 and any(f"'{n}'" in text for n in others)]
    assert not leaked, leaked[:3]
    assert "Traceback" not in server.log_text()
    for name in CHURN_NAMES:
        post(server, "unload_lora_adapter", {"lora_name": name})


def in_process_client(**app_options) -> TestClient:
    """The demo model's app in this process (``create_app`` options as given), for what needs no server process."""
    model = MultiLoraModel(demo.load_base_model(), max_adapters=2)
    engine = Engine(model, DemoTokenizer(), EngineConfig(max_running=2))
    return TestClient(create_app(engine, "demo", **app_options))


def test_a_failed_runtime_load_names_the_clients_path_not_the_real_one(tmp_path):
    """Through a --lora-dir that is a symlink, the loader's error named the resolved path: the server's own file
    system layout, which no response shows."""
    real = tmp_path / "private" / "adapters"
    (real / "broken").mkdir(parents=True)
    (tmp_path / "public").symlink_to(real, target_is_directory=True)
    with in_process_client(lora_dirs=[tmp_path / "public"]) as client:
        path = str(tmp_path / "public" / "broken")
        response = client.post("/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": path})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert path in message and "private" not in message, message


@pytest.mark.parametrize("body", [b'{"model": "demo", "prompt": ', b"\xff\xfe not utf-8", b"[" * 100_000])
def test_a_client_without_the_key_is_refused_before_its_body_is_read(body):
    """The key was checked after FastAPI had read and parsed the body: a client without it got a 400 with the
    parser's words, and could make the server parse megabytes per request."""
    with in_process_client(api_key="secret") as client:
        response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert (response.status_code, response.json()["error"]["code"]) == (401, "invalid_api_key")
        keyed = client.post("/v1/completions", content=body,
                            headers={"content-type": "application/json", "authorization": "Bearer secret"})
        assert keyed.status_code == 400  # with the key, the body is read and refused for what it is
        assert client.get("/health").status_code == 200  # the one route open to all


@pytest.mark.parametrize("key", ["", " secret", "secret\n"])
def test_a_key_no_client_can_send_is_refused(key):
    """An empty key (``--api-key "$KEY"`` with KEY unset) let in anyone who sent ``Bearer `` alone; a key with
    whitespace at an end let in no one (HTTP trims it)."""
    engine = Engine(MultiLoraModel(demo.load_base_model(), max_adapters=1), DemoTokenizer())
    with pytest.raises(ValueError, match="non-empty string without whitespace at its ends"):
        create_app(engine, "demo", api_key=key)


def test_a_failed_load_whose_adapter_was_unloaded_meanwhile_answers_503(tmp_path):
    """While the other replicas are told of a new adapter, it serves here and another call may unload it; the
    load's undo then met no adapter, and its KeyError became a 500."""
    shutil.copytree(demo.adapter_paths()["upper"], tmp_path / "upper")
    engine = Engine(MultiLoraModel(demo.load_base_model(), max_adapters=2), DemoTokenizer())

    def tell_others(name: str, path: str | None) -> None:
        if path is not None:
            engine.unload_adapter(name)  # the concurrent unload
            raise RuntimeError("a replica is down")

    with TestClient(create_app(engine, "demo", lora_dirs=[tmp_path], on_adapters_changed=tell_others)) as client:
        response = client.post("/v1/load_lora_adapter", json={"lora_name": "upper",
                                                                "lora_path": str(tmp_path / "upper")})
        assert (response.status_code, response.json()["error"]["code"]) == (503, "replicas_not_told")
        assert "upper" not in {m["id"] for m in client.get("/v1/models").json()["data"]}


def test_an_unknown_model_name_is_not_sent_back_whole():
    with in_process_client() as client:
        response = client.post("/v1/completions", json={"model": "m" * 100_000, "prompt": "x", "max_tokens": 1})
    assert response.status_code == 404
    assert "m" * 100 + "..." in response.json()["error"]["message"] and len(response.content) < 1_000


@pytest.mark.parametrize("key", ["clé-ünïcode", "ключ", "plain-ascii"])
def test_an_api_key_of_any_characters_matches_its_utf8_bytes(key):
    """A client sends the key's UTF-8 bytes (curl, httpx); they used to be compared after a latin-1 round trip that
    no non-ASCII key survived, so such a key let nobody in."""
    with in_process_client(api_key=key) as client:
        header = b"Bearer " + key.encode()
        assert client.get("/v1/models", headers=[(b"authorization", header)]).status_code == 200
        assert client.get("/v1/models", headers=[(b"authorization", header + b"x")]).status_code == 401
        assert client.get("/v1/models").status_code == 401


@pytest.mark.parametrize("prompts", [[[108, 111, 114, 97, 61], []], [[108, 111, 114, 97, 61], [1, 300]]],
                         ids=["empty-second", "out-of-vocabulary"])
def test_a_refused_request_with_several_prompts_counts_nothing(prompts):
    """A request whose second prompt is refused (400) used to queue the first, then cancel it: counted as a
    finished, cancelled request with a latency sample, though the client was told nothing ran."""
    with in_process_client() as client:
        response = client.post("/v1/completions", json={"model": "demo", "prompt": prompts, "max_tokens": 2})
        assert response.status_code == 400, response.text
        # one request served after it: the engine has handled whatever the refused one left behind
        served = client.post("/v1/completions", json={"model": "demo", "prompt": "lora=", "max_tokens": 2})
        assert served.status_code == 200, served.text
        deadline = time.monotonic() + 30  # its completion is counted just after it is answered
        while 'punica_requests_total{finish_reason="length"} 1.0' not in (metrics := client.get("/metrics").text):
            assert time.monotonic() < deadline, metrics
            time.sleep(0.01)
    assert 'punica_requests_total{finish_reason="cancelled"} 0.0' in metrics
    assert "punica_request_latency_seconds_count 1.0" in metrics

