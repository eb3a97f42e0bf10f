"""Hostile clients against a real ``punica-hf serve --model demo`` process: no request can stall or fail another's.

A flood of requests beyond the server's limits, a 2 MB stop string, a sampling request whose temperature would
overflow and a body over the size limit arrive together with normal requests: each normal request gets the same
text as when it was sent alone, within 2 s of its time alone, and each hostile one a clear error. An adapter whose
scores are NaN fails its own requests only; requests still queued for an adapter that is unloaded get a 404 that
names that adapter alone.
"""

import asyncio
import json
import shutil
import time

import httpx
import pytest
from safetensors.torch import load_file, save_file
from server_process import Server, start_demo_server, wait_until

from punica_hf import demo

API_KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
NORMAL_REQUESTS = [("upper", "punica"), ("reverse", "lora"), ("sort", "adapter"), ("demo", "serving")]
SLOWER_THAN_ALONE_AT_MOST = 2.0  # seconds
CLIENT_TIMEOUT_SECONDS = 60
FLOOD_SIZE = 200
# Bodies beyond the default limits, or values that can never work, and what the server answers each.
BEYOND_LIMITS = [
    ({"temperature": 1e-300}, 400, "temperature must be 0 (greedy) or a number >= 0.0001"),
    ({"stop": ["x"] * 17}, 400, "17 stop strings; this server takes at most 16"),
    ({"stop": "x" * 513}, 400, "a stop string of 513 characters; this server takes at most 512"),
    ({"prompt": ["lora="] * 33}, 400, "33 prompts in one request; this server takes at most 32"),
    ({"stop_token_ids": list(range(17))}, 400, "17 ids; this server takes at most 16"),
    ({"seed": 2**70}, 400, "seed must be an integer from -2**63 to 2**64 - 1"),
    ({"model": "nope"}, 404, "The model 'nope' does not exist"),
    ({"temperature": 1e-300, "stream": True}, 400, "temperature must be 0 (greedy)"),
]


def completion(model: str = "upper", prompt="lora=", **fields) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, **fields}


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    """The server's --lora-dir: "poison", the upper adapter with every weight times 1e30 (its scores overflow to
    NaN), and "doomed", a copy of the sort adapter."""
    folder = tmp_path_factory.mktemp("hostile_lora_dir")
    poison = shutil.copytree(demo.adapter_paths()["upper"], folder / "poison")
    weights = load_file(poison / "adapter_model.safetensors")
    save_file({name: tensor * 1e30 for name, tensor in weights.items()}, poison / "adapter_model.safetensors")
    shutil.copytree(demo.adapter_paths()["sort"], folder / "doomed")
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory, lora_dir):
    process = start_demo_server(API_KEY, lora_dir, tmp_path_factory.mktemp("logs") / "hostile_server.log")
    yield process
    process.stop()


async def raw_completion(server: Server, body: bytes) -> tuple[int, dict]:
    """POST ``body`` to /v1/completions with bare HTTP: a flood from this client costs the server, not the test.

    It sends ``Expect: 100-continue``, as curl does for large bodies: the body goes only once the server asks for
    it, so a body refused unread (413) is not sent at all.
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nExpect: 100-continue\r\n"
        "Connection: close\r\n\r\n"
    )

    async def exchange() -> tuple[bytes, bytes]:
        writer.write(head.encode())
        status_line = await reader.readline()
        if b" 100 " in status_line:
            await reader.readline()  # the blank line that ends the interim response
            writer.write(body)
            status_line = await reader.readline()
        return status_line, await reader.read()

    try:
        status_line, response = await asyncio.wait_for(exchange(), CLIENT_TIMEOUT_SECONDS)
    finally:
        writer.close()
    return int(status_line.split()[1]), json.loads(response.partition(b"\r\n\r\n")[2])


def load_adapter(server: Server, name: str, path) -> None:
    body = {"lora_name": name, "lora_path": str(path)}
    response = httpx.post(f"{server.url}/load_lora_adapter", headers=AUTH, json=body)
    assert response.status_code == 200, response.text


def test_hostile_requests_neither_stall_nor_fail_the_others(server):
    flood = [BEYOND_LIMITS[i % len(BEYOND_LIMITS)] for i in range(FLOOD_SIZE)]
    hostile = [
        *((completion(**fields), status, message) for fields, status, message in flood),
        (completion(stop="x" * 2_000_000), 400, "a stop string of 2000000 characters"),
        (completion(temperature=1e-300, seed=3), 400, "smaller ones overflow the scores"),
        (completion(prompt="x" * 5_000_000), 413, "larger than this server's limit of 4194304 bytes"),
    ]
    hostile_bodies = [json.dumps(body).encode() for body, _, _ in hostile]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=CLIENT_TIMEOUT_SECONDS) as http:

            async def normal(model: str, word: str) -> tuple[str, float]:
                started = time.perf_counter()
                response = await http.post("/completions", json=completion(model, f"{word}="))
                assert response.status_code == 200, response.text
                return response.json()["choices"][0]["text"], time.perf_counter() - started

            alone = [await normal(model, word) for model, word in NORMAL_REQUESTS]
            hostile_answers = [asyncio.create_task(raw_completion(server, body)) for body in hostile_bodies]
            together = await asyncio.gather(*(normal(model, word) for model, word in NORMAL_REQUESTS))
            return alone, together, await asyncio.gather(*hostile_answers)

    alone, together, hostile_answers = asyncio.run(run())
    for request, (alone_text, alone_seconds), (text, seconds) in zip(NORMAL_REQUESTS, alone, together):
        assert text == alone_text, request
        assert seconds < alone_seconds + SLOWER_THAN_ALONE_AT_MOST, (request, alone_seconds, seconds)
    for (_, status, message), (answered_status, answer) in zip(hostile, hostile_answers):
        assert answered_status == status and message in answer["error"]["message"], answer


def test_requests_at_the_limits_are_served(server):
    at_limits = completion(prompt=["lora="] * 32, stop=["x" * 512] + ["Q"] * 15, stop_token_ids=list(range(300, 316)))
    response = httpx.post(f"{server.url}/completions", headers=AUTH, json=at_limits, timeout=CLIENT_TIMEOUT_SECONDS)
    assert response.status_code == 200, response.text
    assert [choice["text"] for choice in response.json()["choices"]] == ["LORA"] * 32


def test_a_body_over_the_size_limit_is_refused(server):
    body = b'{"model": "upper", "prompt": "' + b"x" * 5_000_000 + b'"}'
    too_large = "the request body is larger than this server's limit of 4194304 bytes"
    status, answer = asyncio.run(raw_completion(server, body))  # by its Content-Length, before it is sent
    assert status == 413 and answer["error"]["message"] == too_large

    def chunks():  # no Content-Length: refused once what arrived passes the limit
        for start in range(0, len(body), 65536):
            yield body[start : start + 65536]

    headers = {**AUTH, "Content-Type": "application/json"}
    response = httpx.post(f"{server.url}/completions", headers=headers, content=chunks(),
                          timeout=CLIENT_TIMEOUT_SECONDS)
    assert response.status_code == 413 and response.json()["error"]["message"] == too_large


def test_an_adapter_with_nan_scores_fails_its_own_requests_only(server, lora_dir):
    load_adapter(server, "poison", lora_dir / "poison")
    try:
        for fields in ({}, {"temperature": 1.0, "seed": 1}):
            response = httpx.post(f"{server.url}/completions", headers=AUTH, json=completion("poison", **fields))
            assert response.status_code == 500
            error = response.json()["error"]
            assert error["code"] == "generation_failed" and "NaN or infinite (adapter 'poison')" in error["message"]
        with httpx.stream("POST", f"{server.url}/completions", headers=AUTH,
                          json=completion("poison", stream=True)) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data:")]
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "generation_failed" and "NaN or infinite" in error["message"]
        assert events[-1] == "data: [DONE]"
    finally:
        httpx.post(f"{server.url}/unload_lora_adapter", headers=AUTH, json={"lora_name": "poison"})
    after = httpx.post(f"{server.url}/completions", headers=AUTH, json=completion("upper", "punica="))
    assert after.json()["choices"][0]["text"] == "PUNICA"
    metrics = server.metrics(AUTH)
    assert metrics["punica_running_requests"] == 0 and metrics["punica_kv_cache_free_fraction"] == 1.0


def test_requests_queued_for_an_unloaded_adapter_get_404_naming_it_alone(server, lora_dir):
    load_adapter(server, "doomed", lora_dir / "doomed")
    long_answers = completion("doomed", max_tokens=50, ignore_eos=True)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=CLIENT_TIMEOUT_SECONDS,
                                     limits=httpx.Limits(max_connections=None)) as http:
            requests = [asyncio.create_task(http.post("/completions", json=long_answers)) for _ in range(100)]
            # more waiting than a batch can start (16 on a CPU): some are still in the engine's own queue
            await asyncio.to_thread(wait_until, lambda: server.metrics(AUTH)["punica_queue_length"] > 16)
            unload = await http.post("/unload_lora_adapter", json={"lora_name": "doomed"})
            assert unload.status_code == 200
            return await asyncio.gather(*requests)

    responses = asyncio.run(run())
    statuses = [response.status_code for response in responses]
    assert set(statuses) == {200, 404}, statuses
    for response in responses:
        if response.status_code == 404:
            error = response.json()["error"]
            assert (error["message"], error["code"]) == ("The model 'doomed' does not exist", "model_not_found")
