"""What the Ray Serve replicas need without Ray: ``serve --replicas`` options, and the server telling others about
runtime adapter loads (``create_app(on_adapters_changed=...)``), all or nothing."""

import importlib.util
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from fastapi.testclient import TestClient
from server_process import demo_lora_dir, free_port, start_serve_on_a_free_port

from punica_hf import MultiLoraModel, demo
from punica_hf.cli import main
from punica_hf.cli.serve import (
    RAY_DIRECT_INGRESS_VARIABLE, RAY_INGRESS_DRAIN_VARIABLE, RAY_INGRESS_PORT_VARIABLES, RAY_PORT_QUARANTINE_VARIABLE,
    RAY_THROUGHPUT_VARIABLE, RAY_WORKER_NICENESS_VARIABLE, _watch_listener, bind_listener, ray_app,
)
from punica_hf.serving import DemoTokenizer, Engine, EngineConfig
from punica_hf.serving.app import create_app


def test_serve_help_explains_the_replica_options(capsys):
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--replicas", "--ray-address", "--gpus-per-replica", "--ray-throughput-optimized"):
        assert option in out


@pytest.mark.parametrize("asked, mode", [([], "1"), (["--ray-throughput-optimized", "on"], "1"),
                                         (["--ray-throughput-optimized", "off"], "0")])
def test_the_local_cluster_starts_in_the_ray_serve_mode_asked_for(monkeypatch, capsys, asked, mode):
    """Ray Serve reads its mode from the environment of the cluster's processes: it must be set when the command
    starts the cluster (its processes inherit the command's environment), whatever the command's own was; and the
    cluster is a new one (``address="local"``), never one already running on the machine in another mode."""
    ray = pytest.importorskip("ray", reason="needs the ray extra")
    seen = []

    def init(**options):  # the cluster's start: what its processes would inherit
        ports = tuple(os.environ.get(name) for name in RAY_INGRESS_PORT_VARIABLES)
        seen.append((os.environ.get(RAY_THROUGHPUT_VARIABLE), options.get("address"), ports,
                     os.environ.get(RAY_PORT_QUARANTINE_VARIABLE), os.environ.get(RAY_DIRECT_INGRESS_VARIABLE)))
        # no load balancer before the local ingress: it stops once the requests in flight are answered, not 30 s on
        assert os.environ.get(RAY_INGRESS_DRAIN_VARIABLE) == "1"
        assert os.environ.get(RAY_WORKER_NICENESS_VARIABLE) == "0"  # the replicas at normal priority, not Ray's 15
        raise ConnectionError("no cluster in this test")

    monkeypatch.setattr(ray, "init", init)
    opposite = "0" if mode == "1" else "1"
    monkeypatch.setenv(RAY_THROUGHPUT_VARIABLE, opposite)  # set beforehand
    for name in (RAY_INGRESS_DRAIN_VARIABLE, *RAY_INGRESS_PORT_VARIABLES, RAY_PORT_QUARANTINE_VARIABLE,
                 RAY_WORKER_NICENESS_VARIABLE):
        monkeypatch.setenv(name, "-")
        monkeypatch.delenv(name)  # (set first, so that monkeypatch restores its absence)
    monkeypatch.setenv(RAY_DIRECT_INGRESS_VARIABLE, "0")  # a user's: the ingress on --port needs it on
    port = free_port()
    assert main(["serve", "--model", "demo", "--replicas", "1", "--device", "cpu", "--port", str(port), *asked]) == 1
    assert "no cluster in this test" in capsys.readouterr().err
    # throughput-optimized: the ingress's own HTTP server takes --port (Ray Serve's range is MIN to MAX - 1), and
    # takes it back at once when Ray Serve starts it again
    ingress = ((str(port), str(port + 1)), "0", "1") if mode == "1" else ((None, None), None, "0")
    assert seen == [(mode, "local", *ingress)]
    # and the environment is as it was for what runs in this process afterwards
    assert os.environ[RAY_THROUGHPUT_VARIABLE] == opposite
    for name in (RAY_INGRESS_DRAIN_VARIABLE, *RAY_INGRESS_PORT_VARIABLES, RAY_PORT_QUARANTINE_VARIABLE,
                 RAY_WORKER_NICENESS_VARIABLE):
        assert name not in os.environ
    assert os.environ[RAY_DIRECT_INGRESS_VARIABLE] == "0"


def test_the_operators_worker_priority_stands(monkeypatch, capsys):
    """An operator who set Ray's worker niceness for the command keeps it: the command only changes Ray's default."""
    ray = pytest.importorskip("ray", reason="needs the ray extra")
    seen = []

    def init(**options):
        seen.append(os.environ.get(RAY_WORKER_NICENESS_VARIABLE))
        raise ConnectionError("no cluster in this test")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setenv(RAY_WORKER_NICENESS_VARIABLE, "5")
    assert main(["serve", "--model", "demo", "--replicas", "1", "--device", "cpu", "--port", str(free_port())]) == 1
    assert "no cluster in this test" in capsys.readouterr().err
    assert seen == ["5"] and os.environ[RAY_WORKER_NICENESS_VARIABLE] == "5"


@pytest.mark.parametrize("node_nice, worker_nice", [(0, 0), (4, 0), (0, 3), (4, 3)])
def test_a_replica_measures_its_priority_against_the_process_that_started_it(node_nice, worker_nice):
    """Ray adds its worker niceness to the raylet's nice value: a node started niced as a whole gives its workers
    that priority, which is the operator's choice and no reason to warn; only the levels Ray added are. A process
    started at ``node_nice`` starts a worker that lowers itself by ``worker_nice`` as Ray's do, and the worker reads
    how far below its parent it runs."""
    pytest.importorskip("ray", reason="needs the ray extra")
    worker = ("import os, sys; os.nice(int(sys.argv[1])); "
              "from punica_hf.serving.ray import _priority_below_parent; print(_priority_below_parent())")
    node = ("import os, subprocess, sys; os.nice(int(sys.argv[1])); "
            "print(subprocess.run([sys.executable, '-c', sys.argv[2], sys.argv[3]], capture_output=True, text=True, "
            "check=True).stdout, end='')")
    if os.getpriority(os.PRIO_PROCESS, 0) + node_nice + worker_nice > 19:
        pytest.skip("this test runs too niced to lower two processes further")
    out = subprocess.run([sys.executable, "-c", node, str(node_nice), worker, str(worker_nice)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert int(out) == worker_nice


def test_a_busy_port_fails_before_the_cluster_starts(monkeypatch, capsys):
    ray = pytest.importorskip("ray", reason="needs the ray extra")
    monkeypatch.setattr(ray, "init", lambda **options: pytest.fail("the cluster started"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = ["serve", "--model", "demo", "--replicas", "1", "--device", "cpu", "--host", "127.0.0.1",
                   "--port", str(port)]
        assert main(command) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert main([*command[:-1], "0"]) == 1  # a port the clients could not know
    assert "--replicas needs a fixed --port (not 0)" in capsys.readouterr().err


def test_the_command_stops_once_nothing_has_listened_on_its_port_for_long():
    """Ray Serve gives up for good a port that its restarted ingress found taken: the command must not run on with
    a dead port. A gap shorter than the limit (the ingress started again) is no loss."""
    listener = bind_listener("127.0.0.1", 0)
    port = listener.getsockname()[1]
    stopped = []

    def watch():
        try:
            _watch_listener("127.0.0.1", port, lost_after=0.8, poll=0.05)
        except RuntimeError as error:
            stopped.append((time.monotonic(), str(error)))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(0.5)
    listener.close()
    time.sleep(0.2)
    listener = bind_listener("127.0.0.1", port)  # back within the limit
    time.sleep(1.0)
    assert watcher.is_alive() and not stopped
    listener.close()
    gone = time.monotonic()
    watcher.join(5)
    assert stopped, "the watch did not stop"
    assert stopped[0][0] - gone >= 0.8 and f"nothing has listened on 127.0.0.1:{port} for 1 s" in stopped[0][1]


def test_the_ray_serve_mode_of_a_cluster_that_runs_already_is_refused(capsys, monkeypatch):
    """Another cluster's processes run already in their own mode: an option that says otherwise would be a lie."""
    monkeypatch.delenv(RAY_THROUGHPUT_VARIABLE, raising=False)
    command = ["serve", "--model", "demo", "--ray-address", "10.0.0.1:6379", "--ray-throughput-optimized", "on"]
    assert main(command) == 1
    assert f"set {RAY_THROUGHPUT_VARIABLE}=1 (or 0) where the cluster's nodes start" in capsys.readouterr().err
    assert RAY_THROUGHPUT_VARIABLE not in os.environ
    with pytest.raises(ValueError, match="an application cannot change it"):
        ray_app({"model": "demo", "ray_throughput_optimized": "off"})
    # without Ray Serve at all, the option would be ignored silently
    assert main(["serve", "--model", "demo", "--device", "cpu", "--ray-throughput-optimized", "on"]) == 1
    assert "--ray-throughput-optimized is an option of --replicas" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed here")
def test_replicas_without_ray_say_which_extra_to_install(capsys):
    assert main(["serve", "--model", "demo", "--replicas", "2", "--device", "cpu"]) == 1
    assert "pip install 'punica-hf[ray]'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    return demo_lora_dir(tmp_path_factory.mktemp("lora_dir"))


def demo_client(lora_dir, on_adapters_changed) -> TestClient:
    model = MultiLoraModel(demo.load_base_model(), max_adapters=4)
    model.load_adapters(demo.adapter_paths())
    engine = Engine(model, DemoTokenizer(), EngineConfig(max_running=2))
    return TestClient(create_app(engine, "demo", lora_dirs=[lora_dir], on_adapters_changed=on_adapters_changed))


def test_runtime_loads_and_unloads_are_told_to_the_others(lora_dir):
    told = []
    with demo_client(lora_dir, lambda name, path: told.append((name, path))) as client:
        load = {"lora_name": "sort2", "lora_path": str(lora_dir / "sort_copy")}
        assert client.post("/v1/load_lora_adapter", json=load).status_code == 200
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "sort2"}).status_code == 200
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "sort2"}).status_code == 404
    assert told == [("sort2", str((lora_dir / "sort_copy").resolve())), ("sort2", None)]


def test_a_load_the_others_cannot_be_told_of_is_undone(lora_dir):
    def unreachable(name, path):
        raise ConnectionError("the catalog is down")

    with demo_client(lora_dir, unreachable) as client:
        load = {"lora_name": "sort2", "lora_path": str(lora_dir / "sort_copy")}
        response = client.post("/v1/load_lora_adapter", json=load)
        assert response.status_code == 503 and "the catalog is down" in response.json()["error"]["message"]
        assert "sort2" not in {card["id"] for card in client.get("/v1/models").json()["data"]}
        body = {"model": "sort2", "prompt": "abc=", "max_tokens": 4}
        assert client.post("/v1/completions", json=body).status_code == 404


def test_a_load_the_others_refuse_is_undone_and_answered_409(lora_dir):
    """The replicas' catalog refuses a name another replica changed first (a ValueError): the load is undone here
    and the client told why, so two replicas never serve different adapters under one name."""
    def refuse(name, path):
        raise ValueError(f"the adapter {name!r} was loaded or unloaded on another replica meanwhile")

    with demo_client(lora_dir, refuse) as client:
        load = {"lora_name": "sort2", "lora_path": str(lora_dir / "sort_copy")}
        response = client.post("/v1/load_lora_adapter", json=load)
        assert response.status_code == 409, response.text
        assert response.json()["error"]["code"] == "conflict" and "on another replica" in response.text
        assert "sort2" not in {card["id"] for card in client.get("/v1/models").json()["data"]}



class _ServeThatLosesPorts:
    """Stands in for ``ray.serve``: the first ``lost`` starts fail as Ray Serve's proxy does when its port was
    taken meanwhile, then starts succeed; records every call."""

    def __init__(self, lost: int, error: str = "Failed to bind to address '127.0.0.1:{port}'.") -> None:
        self.lost, self.error, self.calls = lost, error, []

    def start(self, http_options: dict) -> None:
        self.calls.append(("start", http_options["port"]))
        if self.lost:
            self.lost -= 1
            raise RuntimeError(self.error.format(port=http_options["port"]))

    def shutdown(self) -> None:
        self.calls.append(("shutdown", None))


def test_ray_serve_in_the_tests_starts_again_on_another_port_when_its_port_was_taken():
    """The Ray test fixtures pick a free port, and Ray's own processes may take it before the proxy binds it: the
    helper shuts Ray Serve down and starts it on another port; any other error, or too many losses, is raised."""
    serve = _ServeThatLosesPorts(lost=2)
    port = start_serve_on_a_free_port(serve)
    assert [call[0] for call in serve.calls] == ["start", "shutdown", "start", "shutdown", "start"]
    assert serve.calls[-1] == ("start", port)
    with pytest.raises(RuntimeError, match="Failed to bind"):
        start_serve_on_a_free_port(_ServeThatLosesPorts(lost=5), attempts=5)
    other = _ServeThatLosesPorts(lost=1, error="the controller died")
    with pytest.raises(RuntimeError, match="controller died"):
        start_serve_on_a_free_port(other)
    assert other.calls == [("start", other.calls[0][1])]
