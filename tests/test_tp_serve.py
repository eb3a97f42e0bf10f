"""``punica-hf serve --tp 2``: the command starts its 2 ranks itself (gloo on the CPU), rank 0 answers HTTP with
what the unsplit model's engine answers (adapters loaded at runtime too), and a SIGTERM to the command drains, then
stops every rank."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import save_peft_adapter, save_word_level_model
from punica_hf import MultiLoraModel
from punica_hf.serving import Engine, SamplingParams
from server_process import child_env, free_port, metric_samples, wait_for_health

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without torch.distributed")

STARTUP_TIMEOUT_S = 120
PROMPTS = {"a": "w5 w6 w9", None: "w3 w4 w11"}  # adapter (None: the base model) -> prompt


def _unsplit_answers(model_dir, adapters) -> dict:
    model = MultiLoraModel(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), max_rank=8)
    model.load_adapters(adapters)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    with Engine(model, AutoTokenizer.from_pretrained(model_dir)) as engine:
        return {adapter: engine.submit(prompt, adapter, params).result(timeout=60).text
                for adapter, prompt in PROMPTS.items()}


def _serve_tp(model_dir, adapters, log, options=()):
    """``punica-hf serve --tp 2`` running: yields its process and base URL; killed with its ranks at the end."""
    return _serving([sys.executable, "-m", "punica_hf", "serve", "--model", str(model_dir), "--adapter",
                     f"a={adapters['a']}", "--tp", "2", *options], log)


@contextlib.contextmanager
def _serving(command: list[str], log):
    """``command`` (serve's options but --port) running on a free port: yields its process and base URL once it
    answers /health; killed with its ranks at the end."""
    port = free_port()
    command = [*command, "--port", str(port)]
    env = {**child_env(), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as output:
        # Its own session, so a failure ends the ranks with it (killpg), never leaving them behind.
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_for_health(process, base, log, STARTUP_TIMEOUT_S)
            yield process, base
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _wait_until_session_gone(process, timeout: float = 30) -> None:
    """Until the command's session (the ranks and torchrun are in it) is empty."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, "a rank or torchrun outlived the command"
        time.sleep(0.2)


def _completion(base: str, model: str, prompt: str) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=60)


def test_serve_split_over_two_ranks_answers_as_the_unsplit_model_and_drains_on_sigterm(tmp_path):
    model_dir, adapters = save_word_level_model(tmp_path)
    lora_dir = tmp_path / "loras"
    base_model = AutoModelForCausalLM.from_pretrained(model_dir)
    runtime = save_peft_adapter(base_model, lora_dir / "b", r=8, target_modules=["o_proj", "down_proj"], seed=7)
    broken = save_peft_adapter(base_model, lora_dir / "broken", r=4, target_modules=["q_proj"], seed=8)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    expected = _unsplit_answers(model_dir, adapters)
    expected_runtime = _unsplit_answers(model_dir, {"a": runtime})["a"]
    log = tmp_path / "serve.log"
    options = ["--allow-runtime-lora", "--lora-dir", str(lora_dir)]
    with _serve_tp(model_dir, adapters, log, options) as (process, base):
        for adapter, prompt in PROMPTS.items():
            answer = _completion(base, adapter or str(model_dir), prompt).raise_for_status().json()
            assert answer["choices"][0]["text"] == expected[adapter], adapter
        # runtime loads and unloads: every rank follows rank 0's
        load = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(runtime)},
                          timeout=60)
        assert load.status_code == 200, load.text
        answer = _completion(base, "b", PROMPTS["a"]).raise_for_status().json()
        assert answer["choices"][0]["text"] == expected_runtime != expected["a"]
        failed = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(broken)},
                            timeout=60)
        assert failed.status_code == 400 and "could not load" in failed.json()["error"]["message"], failed.text
        assert _completion(base, "c", PROMPTS["a"]).status_code == 404
        assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "b"}, timeout=60).status_code == 200
        assert _completion(base, "b", PROMPTS["a"]).status_code == 404
        assert _completion(base, "a", PROMPTS["a"]).json()["choices"][0]["text"] == expected["a"]
        body = {"model": "a", "prompt": PROMPTS["a"], "max_tokens": 300, "ignore_eos": True, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as stream:
            events = (line[len("data: "):] for line in stream.iter_lines() if line.startswith("data: "))
            next(events)
            process.send_signal(signal.SIGTERM)  # to the command the user started, not to the ranks
            rest = list(events)
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["usage"]["completion_tokens"] == 300
        assert process.wait(timeout=60) == 0, log.read_text()[-6000:]


def test_a_drain_bound_over_ranks_fails_what_is_left_then_stops_every_rank(tmp_path):
    """``--tp 2 --drain-seconds 1``: a SIGTERM, and the requests that cannot finish in 1 s (a stream of 2,000 tokens
    and one queued behind it) fail on rank 0 with a 503 ``shut_down`` (the stream: an error event, then
    ``[DONE]``) while rank 1 drops them as rank 0 does; then the command exits 0 with no rank left."""
    model_dir, adapters = save_word_level_model(tmp_path)
    log = tmp_path / "serve.log"
    with _serve_tp(model_dir, adapters, log, ["--drain-seconds", "1", "--max-running", "1"]) as (process, base):
        body = {"model": "a", "prompt": PROMPTS["a"], "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
        with ThreadPoolExecutor(1) as pool, \
                httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
            events = (line[len("data: "):] for line in stream.iter_lines() if line.startswith("data: "))
            next(events)
            queued = pool.submit(httpx.post, f"{base}/v1/completions", json=body, timeout=60)
            deadline = time.monotonic() + 30
            while metric_samples(httpx.get(f"{base}/metrics", timeout=10).text)["punica_queue_length"] != 1:
                assert time.monotonic() < deadline, "the second request never queued"
                time.sleep(0.1)
            process.send_signal(signal.SIGTERM)
            rest = list(events)
            answer = queued.result()
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["error"]["code"] == "shut_down", rest[-3:]
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "shut_down", answer.text
        assert process.wait(timeout=60) == 0, log.read_text()[-6000:]
        _wait_until_session_gone(process)


def test_a_sigint_to_the_serve_tp_command_stops_every_rank(tmp_path):
    """SIGINT sent to the command alone (``kill -INT``, not a terminal's Ctrl-C, which reaches every process): the
    command used to exit at once and leave torchrun and both ranks serving on the port."""
    model_dir, adapters = save_word_level_model(tmp_path)
    log = tmp_path / "serve.log"
    with _serve_tp(model_dir, adapters, log) as (process, base):
        try:
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=60) == 130, log.read_text()[-6000:]
            _wait_until_session_gone(process)
            with pytest.raises(httpx.TransportError):
                httpx.get(f"{base}/health", timeout=2)
        finally:  # whatever is left of its session
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


@pytest.mark.parametrize("options, problem", [
    (["--model", "demo"], "--tp splits a transformers model"),
    (["--model", "MODEL", "--device", "cpu"], "--tp places each rank where transformers puts it"),
])
def test_serve_tp_refusals_before_anything_loads(tmp_path, capsys, monkeypatch, options, problem):
    from punica_hf.cli import main, ranks, serve

    def must_not_run(*args, **kwargs):
        raise AssertionError("the options were not checked first")

    monkeypatch.setattr(serve, "load_model", must_not_run)
    monkeypatch.setattr(ranks, "launch", must_not_run)
    options = [{"MODEL": str(tmp_path)}.get(option, option) for option in options]
    assert main(["serve", *options, "--port", "0", "--tp", "2"]) == 1
    assert problem in capsys.readouterr().err


def test_serve_tp_lets_torchrun_wait_for_the_drain_before_it_kills_the_ranks(monkeypatch):
    """torchrun kills its ranks 30 s after it passes a signal on, by default: with ``--drain-seconds 600`` the
    clients would get cut connections, not their 503s. The command gives torchrun the drain and a margin, through
    the setting torchrun reads."""
    from torch.distributed.launcher.api import LaunchConfig

    from punica_hf.cli import main, ranks

    started = []

    class Finished:
        def __init__(self, command, env=None):
            started.append((command, env))

        def wait(self):
            return 0

    monkeypatch.setattr(ranks.subprocess, "Popen", Finished)
    assert main(["serve", "--model", "MODEL", "--tp", "2", "--port", "0", "--drain-seconds", "45"]) == 0
    (command, env), = started
    assert "torch.distributed.run" in command and int(env[ranks.TORCHRUN_STOP_VARIABLE]) > 45
    monkeypatch.setenv(ranks.TORCHRUN_STOP_VARIABLE, env[ranks.TORCHRUN_STOP_VARIABLE])
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2)
    assert config.shutdown_timeout == int(env[ranks.TORCHRUN_STOP_VARIABLE])


def _rank_processes(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the ranks a ``--tp`` command started (its torchrun's children)."""
    def children(pid: int) -> list[int]:
        found = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
        return [int(child) for child in found.split()]

    ranks = {}
    for torchrun in children(launcher_pid):
        for pid in children(torchrun):
            variables = Path(f"/proc/{pid}/environ").read_text().split("\0")
            rank = next(variable for variable in variables if variable.startswith("RANK="))
            ranks[int(rank.removeprefix("RANK="))] = pid
    return ranks


def test_a_rank_that_dies_takes_the_server_down_with_a_message(tmp_path):
    model_dir, adapters = save_word_level_model(tmp_path)
    log = tmp_path / "serve.log"
    with _serve_tp(model_dir, adapters, log) as (process, base):
        ranks = _rank_processes(process.pid)
        assert sorted(ranks) == [0, 1]
        os.kill(ranks[1], signal.SIGKILL)
        assert process.wait(timeout=90) == 1
        assert "a rank of --tp 2 failed" in log.read_text()
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{base}/health", timeout=2)


def test_a_step_failing_on_one_rank_answers_with_the_error_and_the_server_exits(tmp_path):
    model_dir, _ = save_word_level_model(tmp_path)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(Path(__file__).with_name("tp_serve_fault_worker.py")), "--model", str(model_dir), "--tp", "2"]
    log = tmp_path / "serve.log"
    with _serving(command, log) as (process, base):
        assert _completion(base, str(model_dir), "w5 w6 w7").status_code == 200
        failed = _completion(base, str(model_dir), "w5 w99 w7")  # rank 1's forward raises on w99
        assert failed.status_code == 500
        assert "rank 1: a step failed: ValueError: injected fault" in failed.json()["error"]["message"]
        assert process.wait(timeout=90) != 0
    assert "rank 1: a step failed: ValueError: injected fault" in log.read_text()
