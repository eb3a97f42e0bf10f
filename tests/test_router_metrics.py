"""``/metrics`` under vLLM's names for Kubernetes routers (the Gateway API Inference Extension's endpoint picker):
queue length, KV-cache usage, and the running and waiting adapters with the adapter limit."""

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import wait_until

from punica_hf import MultiLoraModel, demo
from punica_hf.serving import DemoTokenizer, Engine, EngineConfig, SamplingParams
from punica_hf.serving.app import create_app

LONG = SamplingParams(max_new_tokens=56, ignore_eos=True)


def samples(server) -> dict[str, list]:
    """Every sample of the server's metrics by name: a list of (labels, value)."""
    content, _ = server.metrics.render()
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(content.decode()):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


@pytest.fixture(scope="module")
def server():
    model = MultiLoraModel(demo.load_base_model(), max_adapters=3)
    model.load_adapters(demo.adapter_paths())
    engine = Engine(model, DemoTokenizer(), EngineConfig(max_running=1)).start()
    yield create_app(engine, "demo").state.server
    engine.shutdown(drain=False, timeout=60)


def test_router_metrics_name_the_running_and_waiting_adapters(server):
    running = server.submit([(demo.make_prompt("abc"), "upper", LONG)])[0]
    next(iter(running))  # it has started: the only one that can run (max_running=1)
    waiting = server.submit([(demo.make_prompt("abd"), "sort", LONG), (demo.make_prompt("abe"), None, LONG)])
    found = samples(server)
    (info,) = found["vllm:lora_requests_info"]
    labels, stamp = info
    assert labels == {"running_lora_adapters": "upper", "waiting_lora_adapters": "sort", "max_lora": "3"}
    assert abs(stamp - time.time()) < 60
    assert found["vllm:num_requests_waiting"][0][1] == 2  # the base model's request waits too
    assert found["vllm:num_requests_running"][0][1] == 1
    assert 0 < found["vllm:kv_cache_usage_perc"][0][1] <= 1
    assert found["vllm:gpu_cache_usage_perc"] == found["vllm:kv_cache_usage_perc"]
    for handle in (running, *waiting):
        handle.result(timeout=60)
    wait_until(lambda: samples(server)["vllm:num_requests_running"][0][1] == 0, timeout=60)
    (info,) = samples(server)["vllm:lora_requests_info"]
    assert info[0] == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "3"}
    assert samples(server)["vllm:kv_cache_usage_perc"][0][1] == 0
