"""``punica-hf serve --replicas 1 --tp 2`` on a local Ray cluster (127.0.0.1, no dashboard, usage stats off, no
GPU): one replica that is a tensor-parallel group of two ranks (gloo), rank 0 in the replica's process and rank 1
in a child process the replica started. Answers are compared with the unsplit model's engine; a rank that dies, or
a replica process that dies, gets the whole replica replaced, and no rank outlives its replica.

One cluster for the module; it is shut down even when a test fails (and the ranks die with their replicas).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

ray = pytest.importorskip("ray", reason="needs the ray extra (pip install 'punica-hf[ray]')")
serve = pytest.importorskip("ray.serve", reason="needs the ray extra (pip install 'punica-hf[ray]')")

from helpers import save_peft_adapter, save_word_level_model  # noqa: E402
from server_process import child_env, start_serve_on_a_free_port  # noqa: E402
from test_tp_serve import PROMPTS, _unsplit_answers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from punica_hf.cli import main, ranks  # noqa: E402
from punica_hf.cli import serve as serve_command  # noqa: E402
from punica_hf.serving.follower_ranks import FollowerRanks  # noqa: E402
from punica_hf.serving.ray import REPLICA_HEADER  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without torch.distributed")

REPLACED_WITHIN_S = 60


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The running application, with the adapter "b" loaded at runtime: ``(base URL, model folder, expected)``,
    expected: ``{adapter or None: text}`` of the unsplit model."""
    folder = tmp_path_factory.mktemp("ray_tp")
    model_dir, adapters = save_word_level_model(folder)
    lora_dir = folder / "loras"
    runtime = save_peft_adapter(AutoModelForCausalLM.from_pretrained(model_dir), lora_dir / "b", r=8,
                                target_modules=["o_proj", "down_proj"], seed=7)
    expected = {**_unsplit_answers(model_dir, adapters), "b": _unsplit_answers(model_dir, {"a": runtime})["a"]}
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1",
                                       "CUDA_VISIBLE_DEVICES": ""}})
    try:
        port = start_serve_on_a_free_port(serve)
        app = serve_command.ray_app({  # as `serve run punica_hf.cli.serve:ray_app ...` builds it
            "model": str(model_dir), "adapter": [f"a={adapters['a']}"], "replicas": 1, "tp": 2,
            "allow_runtime_lora": True, "lora_dir": [str(lora_dir)],
        })
        serve.run(app, name="punica-hf", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        load = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(runtime)},
                          timeout=60)
        assert load.status_code == 200, load.text
        yield base, model_dir, expected
    finally:
        serve.shutdown()
        ray.shutdown()


def _completion(base: str, model: str, prompt: str) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=60)


def _check_exact(base: str, model_dir: Path, expected: dict, adapters=("a", "b", None)) -> str:
    """Each adapter's answer (None: the base model) is the unsplit model's; the replica that gave them."""
    replicas = set()
    for adapter in adapters:
        response = _completion(base, adapter or str(model_dir), PROMPTS.get(adapter, PROMPTS["a"]))
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected[adapter], adapter
        replicas.add(response.headers[REPLICA_HEADER])
    (replica,) = replicas
    return replica


def _followers(model_dir: Path) -> dict[int, int]:
    """{pid: parent pid} of the live follower ranks serving ``model_dir`` (their command line names it)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")  # empty for a zombie
            stat = (entry / "stat").read_text()
        except OSError:  # it exited meanwhile
            continue
        if ranks.RANK_OPTION.encode() in command and str(model_dir).encode() in command:
            found[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for_a_new_replica(base: str, model_dir: Path, expected: dict, old: str) -> None:
    """Once the ``old`` replica has noticed that it lost a rank (its /health fails), every request gets a 503 until
    a new replica answers, exactly."""
    deadline = time.monotonic() + REPLACED_WITHIN_S
    while (health := httpx.get(f"{base}/health", timeout=60)).status_code == 200 and health.headers[
        REPLICA_HEADER
    ] == old:
        assert time.monotonic() < deadline, "the replica never noticed that it lost a rank"
        time.sleep(0.1)
    while True:
        response = _completion(base, "a", PROMPTS["a"])
        if response.status_code == 200 and response.headers[REPLICA_HEADER] != old:
            _check_exact(base, model_dir, expected)
            return
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] in ("replica_lost", "engine_not_running"), response.text
        assert time.monotonic() < deadline, f"no new replica within {REPLACED_WITHIN_S} s: {response.text}"
        time.sleep(0.5)


def _wait_until_gone(pid: int, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        assert time.monotonic() < deadline, f"{what} still runs after {seconds} s"
        time.sleep(0.1)


def _one_follower(model_dir: Path) -> tuple[int, int]:
    """``(pid, parent pid)`` of the one follower rank; its parent is the replica's process."""
    followers = _followers(model_dir)
    assert len(followers) == 1, followers
    ((pid, parent),) = followers.items()
    assert _alive(parent)
    return pid, parent


def test_the_split_replica_answers_as_the_unsplit_model(served):
    base, model_dir, expected = served
    assert expected["b"] != expected["a"]
    _check_exact(base, model_dir, expected)
    _one_follower(model_dir)  # rank 1, a child of the replica's process


def test_a_follower_that_dies_gets_the_replica_replaced(served):
    base, model_dir, expected = served
    old = _check_exact(base, model_dir, expected)
    follower, replica_process = _one_follower(model_dir)
    os.kill(follower, signal.SIGKILL)
    # The new replica has the runtime adapter "b" too: its rank 0 loads it from the catalog, on every rank.
    _wait_for_a_new_replica(base, model_dir, expected, old)
    new_follower, new_replica_process = _one_follower(model_dir)
    assert new_follower != follower and new_replica_process != replica_process
    _wait_until_gone(replica_process, 30, "the old replica's process")


def test_the_follower_dies_with_its_replica_process(served):
    base, model_dir, expected = served
    old = _check_exact(base, model_dir, expected)
    follower, replica_process = _one_follower(model_dir)
    os.kill(follower, signal.SIGSTOP)  # stopped, it cannot notice by itself that rank 0 has gone
    try:
        os.kill(replica_process, signal.SIGKILL)  # no shutdown runs: the kernel ends the child
        _wait_until_gone(follower, 10, "the follower of a dead replica process")
    finally:
        if _alive(follower):
            os.kill(follower, signal.SIGKILL)
    _wait_for_a_new_replica(base, model_dir, expected, old)
    assert _one_follower(model_dir)[1] != replica_process


def test_followers_die_with_the_thread_that_started_them():
    """The kernel's part (PR_SET_PDEATHSIG), without Ray's clean-up (the raylet also ends a dead replica's process
    group): a replica starts its followers from its event-loop thread, and they die when it ends."""
    started = []
    thread = threading.Thread(target=lambda: started.append(FollowerRanks(2, ["-c", "import time; time.sleep(60)"])))
    thread.start()
    thread.join()
    (followers,) = started
    try:
        assert followers.processes[1].wait(timeout=10) == -signal.SIGKILL
        with pytest.raises(RuntimeError, match="rank 1 of this replica's tensor-parallel group exited"):
            followers.check()
    finally:
        followers.stop(timeout=0)


def test_a_follower_that_fails_to_start_fails_its_replica_at_once():
    """Rank 0 would wait for a missing rank in the rendezvous for half an hour: the replica fails instead (and Ray
    Serve starts another)."""
    script = ("from punica_hf.serving.follower_ranks import FollowerRanks\n"
              "FollowerRanks(2, ['-c', 'raise SystemExit(3)']).join_and(lambda: None)")
    result = subprocess.run([sys.executable, "-c", script], env=child_env(), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1
    assert "rank 1 of this replica's tensor-parallel group exited (exit code 3)" in result.stderr, result.stderr


@pytest.mark.parametrize("options, problem", [
    (["--model", "demo"], "--tp splits a transformers model"),
    (["--model", "MODEL", "--device", "cpu"], "--tp places each rank where transformers puts it"),
    (["--model", "MODEL", "--gpus-per-replica", "1"], "--gpus-per-replica must be at least 2"),
])
def test_tp_refusals_hold_on_ray(tmp_path, capsys, monkeypatch, options, problem):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the options were not checked first")

    for module, name in ((serve_command, "load_model"), (serve_command, "_run_on_ray"), (ranks, "launch")):
        monkeypatch.setattr(module, name, must_not_run)
    options = [{"MODEL": str(tmp_path)}.get(option, option) for option in options]
    assert main(["serve", *options, "--replicas", "2", "--tp", "2"]) == 1
    assert problem in capsys.readouterr().err
    as_config = {option.removeprefix("--"): value for option, value in zip(options[::2], options[1::2])}
    with pytest.raises(ValueError, match=re.escape(problem)):
        serve_command.ray_app({**as_config, "replicas": 2, "tp": 2})
