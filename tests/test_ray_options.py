"""What the Ray Serve replicas need without Ray: ``serve --replicas`` options, and the server telling others about
runtime adapter loads (``create_app(on_adapters_changed=...)``), all or nothing."""

import importlib.util

import pytest
from fastapi.testclient import TestClient
from server_process import demo_lora_dir

from punica_hf import MultiLoraModel, demo
from punica_hf.cli import main
from punica_hf.serving import DemoTokenizer, Engine, EngineConfig
from punica_hf.serving.app import create_app


def test_serve_help_explains_the_replica_options(capsys):
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--replicas", "--ray-address", "--gpus-per-replica"):
        assert option in out


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

