"""``punica-hf serve`` as a real server process on a free port, for the server tests (``from server_process import
Server``)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

STARTUP_TIMEOUT_SECONDS = 120


class Server:
    """A ``punica-hf serve`` process; ``url`` ends with ``/v1``."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.log_path = log_path
        self.log = open(log_path, "w")
        command = [sys.executable, "-m", "punica_hf", "serve", *args, "--port", str(self.port), "--device", "cpu"]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=child_env())
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base}/v1"
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {log_path.read_text()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start: {log_path.read_text()}")
            time.sleep(0.2)

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        """Every sample of ``/metrics`` (see ``metric_samples``)."""
        return metric_samples(httpx.get(f"{self.base}/metrics", headers=headers or {}).raise_for_status().text)

    def log_text(self) -> str:
        """What the server has logged so far (stdout and stderr)."""
        self.log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log.close()


def metric_samples(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text: ``name{label="value",...}`` (labels sorted), or ``name``, -> value."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def wait_for_health(process: subprocess.Popen, base: str, log_path: Path,
                    timeout: float = STARTUP_TIMEOUT_SECONDS) -> None:
    """Until the server at ``base`` answers ``/health``; fails with its log's end if it exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, f"the server exited:\n{log_path.read_text()[-6000:]}"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the server did not start:\n{log_path.read_text()[-6000:]}"
        time.sleep(0.3)


def start_demo_server(api_key: str, lora_dir: Path, log_path: Path) -> Server:
    """The demo model behind ``api_key``, loading adapters at run time from under ``lora_dir`` only."""
    return Server(["--model", "demo", "--api-key", api_key, "--allow-runtime-lora", "--lora-dir", str(lora_dir)],
                  log_path)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_serve_on_a_free_port(serve, attempts: int = 5) -> int:
    """``serve.start`` (``serve``: the ``ray.serve`` module) listening on a free local port, which it returns. A port
    found free can be taken before Ray Serve's proxy binds it (a Ray cluster's processes keep opening ports): on that
    failure Ray Serve is shut down and started again on another port."""
    for attempt in range(attempts):
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return port
        except RuntimeError as error:  # Ray raises the proxy's error as a RayTaskError that is also a RuntimeError
            if "Failed to bind" not in str(error) or attempt == attempts - 1:
                raise
            serve.shutdown()
    raise AssertionError("unreachable")


def child_env() -> dict[str, str]:
    """The test's environment, with this checkout first on the path (the tests may run from another folder)."""
    root = str(Path(__file__).absolute().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def wait_until(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.05)


def demo_lora_dir(folder: Path) -> Path:
    """``folder`` as an allowed --lora-dir: it receives a copy of the demo's sort adapter, ``sort_copy``."""
    from punica_hf import demo

    shutil.copytree(demo.adapter_paths()["sort"], folder / "sort_copy")
    return folder


def offline_demo_answers(words: list[str]) -> dict:
    """The demo model's greedy answers, offline: adapter (None for the base model) -> word -> answer."""
    from punica_hf import MultiLoraModel, demo

    model = MultiLoraModel(demo.load_base_model(), max_adapters=len(demo.TASKS))
    model.load_adapters(demo.adapter_paths())
    return {
        adapter: dict(zip(words, demo.generate_answers(model, words, adapter_ids=[adapter] * len(words))))
        for adapter in [*demo.TASKS, None]
    }
