"""The benchmarks' own measuring code, where it can mislead without any kernel running (CPU)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import save_peft_adapter, tiny_llama
from opaque_kernels import route_to_opaque_kernels
from server_process import child_env
from transformers import CompileConfig

from punica_hf import MultiLoraModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_generate import StepTimer, build_llama, factor_bytes, llama_config, random_adapter  # noqa: E402
from bench_step_lora import CALLS, lora_floor_bytes  # noqa: E402
from profile_engine_steps import kinds_of  # noqa: E402
from thread_profile import cpu_of_tree, cpu_shares, descendants_of, summarize  # noqa: E402


class HostClockEvent:
    """Stands in for ``torch.cuda.Event`` on the CPU: records the host clock."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = None

    def record(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: HostClockEvent) -> float:
        return 1e3 * (end.at - self.at)


@torch.no_grad()
def test_step_timer_times_each_compiled_step_without_changing_how_it_runs(tmp_path, monkeypatch):
    """``StepTimer`` wraps the compiled decode step of every system for the whole run. Timed steps must run as
    untimed ones do (no compiler stance changed, same tokens), and each one is recorded."""
    base = tiny_llama()
    model = MultiLoraModel(copy.deepcopy(base), max_adapters=2, max_rank=8)
    model.load_adapters({"a": save_peft_adapter(base, tmp_path / "a", r=4, target_modules=["q_proj", "v_proj"])})
    route_to_opaque_kernels(model, monkeypatch)  # one graph per step, as on the GPU
    monkeypatch.setattr(torch.cuda, "Event", HostClockEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    skipping = []
    set_stance = torch.compiler.set_stance

    def spy(*args, **kwargs):
        skipping.append(kwargs.get("skip_guard_eval_unsafe", False))
        return set_stance(*args, **kwargs)

    monkeypatch.setattr(torch.compiler, "set_stance", spy)
    compile_config = CompileConfig(backend="eager", mode=None)
    compile_config._compile_all_devices = True  # transformers' switch to compile generate() off CUDA (for tests)
    new_tokens = 6  # the prefill runs eagerly: 5 compiled decode steps
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])

    def generate():
        return model.generate(ids, attention_mask=torch.ones_like(ids), adapter_ids=["a", None],
                              max_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                              compile_config=compile_config)

    timer = StepTimer(model.model)
    try:
        untimed = generate()  # compiles, as a benchmark's warm-up does
        skipping.clear()
        timing = timer.record(generate, skipped=2)
        assert skipping == [], skipping  # nothing skips Dynamo's guard checks
        assert torch.equal(generate(), untimed)
    finally:
        torch._dynamo.reset()
    assert timing["steps"] == new_tokens - 1 - 2
    # Medians of different steps (the last step has no period after it): on a busy host one step's time inside
    # the call can exceed the median period, so each is bounded by what holds step by step.
    assert 0 < timing["host_in_call_ms"] < timing["call_ms"]
    assert 0 < timing["period_ms"] <= timing["steady_ms"]
    assert timing["gpu_call_ms"] > 0
    parts = [timing[key] for key in ("before_steps_ms", "settling_ms", "steady_ms", "after_steps_ms")]
    assert min(parts) > 0 and sum(parts) == pytest.approx(timing["call_ms"])
    assert timer.calls is None  # recording ends with the call


def test_step_benchmark_floor_counts_the_adapter_bytes_that_bench_generate_counts():
    """``bench_step_lora.py`` rebuilds a Llama-3-8B step's LoRA calls by hand; its bytes floor must count one
    adapter's factors as ``bench_generate.py`` counts them on the real model (every targeted projection of 32
    layers), or the two benchmarks' "x its floor" figures, quoted side by side, would not compare."""
    model = build_llama(llama_config(32), torch.device("meta"))
    adapter = random_adapter(model, 16, torch.Generator().manual_seed(0))
    activations = lora_floor_bytes(0, 16, list(CALLS))  # x read and updates written, no factors
    assert activations > 0
    for distinct in (1, 32):
        assert lora_floor_bytes(distinct, 16, list(CALLS)) - activations == distinct * factor_bytes(adapter)


IMPORT_EACH_SCRIPT = r"""
import importlib, importlib.util, json, os, sys
from pathlib import Path

for blocked in filter(None, os.environ.get("BLOCKED_MODULES", "").split(",")):
    sys.modules[blocked] = None  # `import blocked` now raises ModuleNotFoundError, as where it is not installed
    try:
        importlib.import_module(blocked)
    except ImportError:
        pass
    else:
        raise SystemExit(f"{blocked} still imports: the check would pass where it is installed")
results, clean_path = {}, list(sys.path)
for script in map(Path, sys.argv[1:]):
    # as `python benchmarks/.../script.py` would: the script's own folder first on the path, nothing else of ours
    sys.path[:] = [str(script.parent), *clean_path]
    for name in [n for n, m in sys.modules.items() if "benchmarks" in str(getattr(m, "__file__", "") or "")]:
        del sys.modules[name]
    spec = importlib.util.spec_from_file_location(f"script_{script.stem}", script)
    try:
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
        spec.loader.exec_module(module)
        results[str(script)] = "ok"
    except ModuleNotFoundError as error:
        results[str(script)] = f"missing {error.name}"
    except Exception as error:
        results[str(script)] = f"error {type(error).__name__}: {error}"
print(json.dumps(results))
"""


def import_each_script(blocked: tuple[str, ...] = ()) -> tuple[list[Path], dict[str, str]]:
    """Every benchmark script, and each one's outcome when imported in a fresh interpreter with ``blocked``
    modules made unimportable: "ok", "missing <module>" or "error <type>: <message>"."""
    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    scripts = sorted(folder.rglob("*.py"))
    environment = {**os.environ, "BLOCKED_MODULES": ",".join(blocked), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", IMPORT_EACH_SCRIPT, *map(str, scripts)], capture_output=True,
                            text=True, timeout=600, cwd=folder.parent / "tests", env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    return scripts, json.loads(result.stdout.strip().splitlines()[-1])


def test_every_benchmark_script_imports_from_where_it_lives():
    """Each script must find what it imports when run from its own folder (the shared CUDA-graph helper
    ``benchmarks/cuda_graph.py``, the other scripts): nothing runs on import, so this holds on the CPU."""
    scripts, outcomes = import_each_script()
    assert len(outcomes) == len(scripts) >= 8
    assert {outcome for outcome in outcomes.values()} == {"ok"}, outcomes


def test_every_benchmark_script_imports_without_triton_or_a_gpu():
    """The README's CPU install has torch without triton, and the test suite imports benchmark scripts: a script
    importing a GPU-only tool at module level stops ``pytest`` at collection. GPU-only tools are imported where
    they are used, so every script imports with triton unimportable and no GPU visible."""
    scripts, outcomes = import_each_script(blocked=("triton",))
    assert len(outcomes) == len(scripts) >= 8
    assert {outcome for outcome in outcomes.values()} == {"ok"}, outcomes


def test_ray_benchmark_smoke_run_measures_both_servers_on_the_same_workload(tmp_path):
    """``bench_ray.py --smoke`` (the demo model on the CPU, a local Ray cluster): both systems serve every request
    of one workload to its last token (the script checks each stream's count), the Ray system answers through one
    Ray Serve replica and the engine's own server through none, and the ratios are those of the measurements."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("needs the ray extra (pip install 'punica-hf[ray]')")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_ray.py"
    output = tmp_path / "bench_ray.json"
    command = [sys.executable, str(script), "--smoke", "--output", str(output), "--workdir", str(tmp_path / "work")]
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if py_spy:  # the engine process's threads recorded during each system's saturation run
        command += ["--profile-servers", py_spy, "--profile-seconds", "2"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env())
    try:
        log, _ = process.communicate(timeout=300)  # about a minute on an idle machine of 2 cores
    except subprocess.TimeoutExpired:
        process.terminate()  # the script stops its servers on SIGTERM
        log, _ = process.communicate(timeout=120)
        pytest.fail(f"bench_ray.py --smoke ran past 300 s:\n{log[-4000:]}")
    assert process.returncode == 0, log[-4000:]
    report = json.loads(output.read_text())
    engine, ray = report["systems"]["engine"], report["systems"]["ray serve, 1 replica"]
    for system in (engine, ray):
        assert system["saturation"]["requests"] == 12 and system["low_load"]["requests"] == 5
        assert 0 < system["low_load"]["ttft_p50_ms"] <= system["low_load"]["ttft_p90_ms"]
    assert engine["saturation"]["tokens"] == ray["saturation"]["tokens"] > 0
    for system in (engine, ray):  # the engine's counters over the run: every token it generated, in its steps
        run = system["saturation"]
        assert run["engine_steps"] > 0 and 0 < run["tokens_per_step"] <= 4  # 4 clients
        assert run["engine_steps"] * run["tokens_per_step"] == pytest.approx(run["tokens"])
        assert run["ms_per_step"] == pytest.approx(1e3 * run["seconds"] / run["engine_steps"])
        assert system["saturation_ms_per_step"] == [run["ms_per_step"]]  # one run: the median one
    assert engine["saturation"]["replicas"] == engine["low_load"]["replicas"] == []
    assert len(ray["saturation"]["replicas"]) == 1 and ray["low_load"]["replicas"] == ray["saturation"]["replicas"]
    # through Ray, each TTFT splits into its time inside the replica and outside it; the engine's server has no split
    assert "in_replica_p50_ms" not in engine["low_load"]
    assert 0 < ray["low_load"]["in_replica_p50_ms"] and 0 < ray["low_load"]["outside_replica_p50_ms"]
    assert ray["low_load"]["in_replica_p50_ms"] < ray["low_load"]["ttft_p90_ms"]
    for system in (engine, ray):  # the CPU time of the server's process tree over the first saturation run
        shares = system["process_cpu"]
        assert shares == sorted(shares, key=lambda share: -share["cpu_share"]) and shares[0]["cpu_share"] > 0
    assert len(engine["process_cpu"]) == 1  # the server's own process, nothing below it
    assert any("EngineReplica" in share["process"] and share["cpu_share"] > 0 for share in ray["process_cpu"])
    for system in (engine, ray) if py_spy else ():
        threads, gil = system["server_profile"]["threads"], system["server_profile"]["gil"]
        assert threads["samples"] > 0 and sum(t["share"] for t in threads["threads"]) == pytest.approx(1)
        assert "punica-hf-engine" in {t["thread"].split(": ")[-1] for t in threads["threads"]}
        assert 0 < gil["gil_held_share"] <= 1
    comparison = report["comparison"]
    assert comparison["throughput_ratio"] == pytest.approx(
        ray["saturation"]["tokens_per_second"] / engine["saturation"]["tokens_per_second"])
    assert comparison["ttft_p50_overhead_ms"] == pytest.approx(
        ray["low_load"]["ttft_p50_ms"] - engine["low_load"]["ttft_p50_ms"])


def test_thread_profile_gives_each_threads_share_and_where_its_samples_end():
    """py-spy's collapsed stacks: a thread's share counts its samples whatever its id, and a sample is placed at its
    innermost punica_hf frame (else its innermost frame), one entry per function whatever the line."""
    raw = "\n".join([
        "thread (11): punica-hf-engine;Thread.run (threading.py:982);Engine._loop (punica_hf/serving/engine.py:428)"
        ";lora_add (punica_hf/ops/torch_ops.py:40);einsum (torch/functional.py:373) 5",
        "thread (11): punica-hf-engine;Thread.run (threading.py:982);Engine._loop (punica_hf/serving/engine.py:431) 1",
        "thread (12): punica-hf-engine;Thread.run (threading.py:982);Engine._loop (punica_hf/serving/engine.py:428) 2",
        "thread (13): AsyncIO Thread: default;Thread.run (threading.py:982);packb (msgpack/__init__.py:35) 2",
        "",
        "not a stack line",
    ])
    summary = summarize(raw)
    assert summary["samples"] == 10
    assert summary["most_of_one_thread"] == 6  # thread 11: two threads of one name are two threads here
    engine, loop = summary["threads"]
    assert (engine["thread"], engine["share"]) == ("thread: punica-hf-engine", pytest.approx(0.8))
    assert engine["frames"] == [{"frame": "lora_add", "share": pytest.approx(0.5)},
                                {"frame": "Engine._loop", "share": pytest.approx(0.3)}]
    assert (loop["thread"], loop["share"], loop["frames"]) == (
        "thread: AsyncIO Thread: default", pytest.approx(0.2), [{"frame": "packb", "share": pytest.approx(0.2)}])


def test_process_cpu_counts_the_time_each_process_of_a_tree_used_between_two_readings():
    """A child that spins shows about a core's share of the time between two readings; one that sleeps, nearly
    none; a process outside the tree, not at all. Each with its nice value."""
    spin = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass"
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; children = [subprocess.Popen([sys.executable, '-c', "
         "code]) for code in (sys.argv[1], 'import os, time; os.nice(7); time.sleep(30)')]; "
         "print(*[c.pid for c in children], "
         "flush=True); time.sleep(30)", spin], stdout=subprocess.PIPE, text=True)
    outsider = subprocess.Popen([sys.executable, "-c", spin])
    children = []
    try:
        children = [int(pid) for pid in parent.stdout.readline().split()]
        spinner, sleeper = children
        deadline = time.monotonic() + 30
        while not any(key[0] == sleeper and nice == 7 for key, (_, _, nice) in cpu_of_tree(parent.pid).items()):
            assert time.monotonic() < deadline, "the sleeping child never ran"
            time.sleep(0.05)
        before = cpu_of_tree(parent.pid)
        start = time.monotonic()
        time.sleep(1.0)
        readings = {int(share["process"].split()[0]): share
                    for share in cpu_shares(before, cpu_of_tree(parent.pid), time.monotonic() - start)}
        shares = {pid: share["cpu_share"] for pid, share in readings.items()}
        assert set(shares) == {parent.pid, spinner, sleeper}
        assert shares[spinner] > 0.5 and shares[sleeper] < 0.1 and shares[parent.pid] < 0.1, shares
        assert (readings[sleeper]["nice"], readings[spinner]["nice"]) == (7, os.nice(0))
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for process in (parent, outsider):
            process.kill()
            process.wait()


def test_process_cpu_tells_a_reused_pid_from_the_process_it_had_and_refuses_no_time():
    reading = {(100, 5): ("old", 50.0, 0)}
    assert cpu_shares(reading, {(100, 9): ("new", 0.5, 15)}, 1.0) == [
        {"process": "100 new", "cpu_share": 0.5, "nice": 15}]
    assert cpu_shares(reading, {(100, 5): ("old", 50.5, 0)}, 2.0) == [
        {"process": "100 old", "cpu_share": 0.25, "nice": 0}]
    with pytest.raises(ValueError, match="seconds must be positive"):
        cpu_shares(reading, reading, 0.0)


def test_the_gil_share_is_counted_against_the_samples_asked_for(tmp_path):
    """py-spy's --idle recording falls behind on a busy machine: the GIL's share is the GIL recording's samples
    over those asked for (rate x seconds), not over what the other recording managed to take."""
    from thread_profile import Recordings

    fake = tmp_path / "py-spy"  # writes 40 GIL samples, or 2 threads x 60 samples (of 100 asked for)
    fake.write_text("#!" + sys.executable + "\nimport sys\nargs = sys.argv\n"
                    "out = open(args[args.index('--output') + 1], 'w')\n"
                    "if '--gil' in args:\n    out.write('thread (1): main;f (a.py:1) 40\\n')\n"
                    "else:\n    out.write('thread (1): main;f (a.py:1) 60\\nthread (2): pool;g (b.py:2) 60\\n')\n")
    fake.chmod(0o755)
    gil, threads = (Recordings(str(fake), os.getpid(), 1.0, tmp_path, rate=100).finish()[mode]
                    for mode in ("gil", "threads"))
    assert gil["gil_held_share"] == pytest.approx(0.4) and gil["samples_asked"] == 100
    assert (threads["samples_taken"], threads["samples_asked"]) == (60, 100)


@pytest.mark.parametrize("option, values", [
    ("--stream-interval-ms", "20000"), ("--stream-interval-ms", "50,050"), ("--stream-interval-ms", "50,abc"),
    ("--stream-interval-ms", ""), ("--ray-worker-niceness", "0,0"), ("--ray-worker-niceness", "20"),
    ("--ray-worker-niceness", "x"),
])
def test_bad_system_lists_are_refused_before_anything_runs(option, values, monkeypatch, capsys):
    """Each stream interval is read as serve reads it, each nice value as the kernel takes it, and the values must
    differ: a bad one used to fail only when its system's server refused it, after the systems before it had been
    measured."""
    import bench_ray

    monkeypatch.setattr(sys, "argv", ["bench_ray.py", "--smoke", option, values])
    monkeypatch.setattr(bench_ray, "run_system", lambda *args, **kwargs: pytest.fail("a system ran"))
    with pytest.raises(SystemExit) as exit_:
        bench_ray.main()
    assert exit_.value.code == 2 and option in capsys.readouterr().err


def test_each_ray_system_gets_its_interval_priority_and_mode():
    from bench_ray import RAY_SYSTEM, plan_systems

    systems = plan_systems(["--model", "m"], [None, 200], [0, 15], ["throughput"], None)
    assert list(systems) == ["engine", RAY_SYSTEM, f"{RAY_SYSTEM}, workers at nice 15",
                             f"{RAY_SYSTEM}, 200 ms stream interval", f"{RAY_SYSTEM}, 200 ms stream interval, "
                             "workers at nice 15"]
    assert systems["engine"] == (["--model", "m"], None)
    args, environment = systems[f"{RAY_SYSTEM}, 200 ms stream interval, workers at nice 15"]
    assert args == ["--model", "m", "--replicas", "1", "--stream-interval-ms", "200", "--ray-throughput-optimized",
                    "on"] and environment == {"RAY_worker_niceness": "15"}
    assert systems[RAY_SYSTEM][1] == {"RAY_worker_niceness": "0"}
    # another cluster: its own mode and priority
    assert plan_systems(["--model", "m"], [None], [None], [], "10.0.0.1:6379") == {
        "engine": (["--model", "m"], None),
        RAY_SYSTEM: (["--model", "m", "--replicas", "1", "--ray-address", "10.0.0.1:6379"], None)}


def test_thread_profile_finds_the_marked_processes_below_a_process_only():
    """A Ray replica has a process group of its own: it is found as a descendant of the command, by its title."""
    marker = f"marked-{os.getpid()}-{time.monotonic_ns()}"
    parent = subprocess.Popen(  # its own command line lacks the marker; its child's has it
        [sys.executable, "-c", "import os, subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', "
         "'import time; time.sleep(60)', os.environ['MARK']]); print(child.pid, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "MARK": marker})
    outsider = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])  # not below parent
    child = None
    try:
        child = int(parent.stdout.readline())
        assert descendants_of(parent.pid, marker) == [child]
        assert descendants_of(os.getpid(), marker) == sorted([child, outsider.pid])
        assert descendants_of(child, marker) == []
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        for process in (parent, outsider):
            process.kill()
            process.wait()


def test_adapter_kinds_benchmark_smoke_run_times_every_kind_with_its_feature_at_work(tmp_path):
    """``bench_adapter_kinds.py --tiny``: every kind of both models is timed at every step, each ratio is that of
    the timings, and every kind's adapters did run: each changes the base model's logits, and each feature beyond
    plain LoRA (whose adapters hold the same plain factors) changes plain LoRA's."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_adapter_kinds.py"
    output = tmp_path / "kinds.json"
    result = subprocess.run([sys.executable, str(script), "--tiny", "--output", str(output)], capture_output=True,
                            text=True, timeout=300, env=child_env())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(output.read_text())
    assert report["errors"] == []
    rows = report["rows"]
    kinds = {"llama": ["base", "lora", "dora", "lora_bias", "vocab", "alora"], "moe": ["base", "lora", "experts"]}
    cases = ["decode 4", "decode 8", "prefill 2x24"]
    eager = {(r["model"], r["kind"], r["case"]): r for r in rows if r["mode"] == "eager"}
    assert set(eager) == {(model, kind, case) for model, names in kinds.items() for kind in names for case in cases}
    for (model, kind, case), row in eager.items():
        assert row["ms"] > 0
        assert row["to_lora"] == pytest.approx(row["ms"] / eager[(model, "lora", case)]["ms"])
        assert row["to_base"] == pytest.approx(row["ms"] / eager[(model, "base", case)]["ms"])
    graph_rows = [r for r in rows if r["mode"] == "cuda graph"]
    assert {r["model"] for r in graph_rows} <= {"llama"}  # MoE steps are never captured
    if torch.cuda.is_available():  # every decode step of every Llama kind, replayed
        assert len(graph_rows) == 2 * len(kinds["llama"]) and all(r["ms"] for r in graph_rows), graph_rows
    else:
        assert graph_rows == []
    changes = report["max_abs_logit_change"]
    for model, names in kinds.items():
        assert set(changes[model]) == set(names) - {"base"}
        for kind in names[1:]:
            assert changes[model][kind]["base"] > 1e-3, (model, kind)
        for kind in names[2:]:
            assert changes[model][kind]["lora"] > 1e-3, (model, kind)


def run_bench_serving(tmp_path: Path, *options: str) -> dict:
    """``bench_serving.py --tiny`` with ``options`` in a fresh process (as the GPU session runs it); its report."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_serving.py"
    output = tmp_path / f"bench_serving{'_'.join(options)}.json"
    result = subprocess.run([sys.executable, str(script), "--tiny", *options, "--output", str(output)],
                            capture_output=True, text=True, timeout=240, env=child_env())
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return json.loads(output.read_text())


def test_serving_benchmark_workload_options_measure_what_they_name(tmp_path):
    """Each workload option of ``bench_serving.py`` runs on the CPU (the GPU session runs them unrehearsed) and
    measures its own workload: mixed ranks make the store swap adapters while serving; long prompts fill the step's
    token budget; shared prefixes are served from cached pages only with caching on, with the same greedy tokens
    as without; the small model (its requests sampling) reports its base engine's throughput against its target.
    The default run still ends cleanly where matplotlib is not installed."""
    mixed = run_bench_serving(tmp_path, "--mixed-ranks")
    adapters, base = (mixed["systems"][name]["saturation"] for name in
                      ("engine, 12 adapters of ranks 2-16", "engine, base model"))
    assert adapters["tokens"] == base["tokens"] > 0 and adapters["prompt_tokens"] == base["prompt_tokens"]
    assert adapters["adapter_store"]["host_loads"] > 0 and adapters["adapter_store"]["evictions"] > 0
    assert base["adapter_store"]["host_loads"] == 0
    assert mixed["adapter_stats"]["registered"] == 12 and mixed["adapter_stats"]["resident"] <= 4
    assert mixed["targets"]["adapters_vs_base_at_saturation"] == pytest.approx(
        adapters["tokens_per_second"] / base["tokens_per_second"])

    long = run_bench_serving(tmp_path, "--long-prompts")
    assert long["systems"]["engine, 4 adapters"]["saturation"]["prompt_tokens"] / 16 > 100  # median 120
    for name, steps in long["engine_steps"].items():
        full = steps["mixed"]["full"]
        assert full["step_budget"] == 256 and full["steps"] > 0 and full["median_tokens"] >= 0.95 * 256, name
        assert long["targets"]["full_mixed_step_ms"][name] == full["median_ms"]

    shared = run_bench_serving(tmp_path, "--shared-prefixes")
    on, off = (shared["systems"][f"engine, 4 adapters, prefix caching {state}"] for state in ("on", "off"))
    assert len(on["runs"]) == len(off["runs"]) == 1  # at saturation, then Poisson at half of it
    for run_on, run_off in zip([on["saturation"], *on["runs"]], [off["saturation"], *off["runs"]]):
        assert run_on["prompt_tokens"] == run_off["prompt_tokens"]
        assert 0 < run_on["prefix_hit_tokens"] < run_on["prompt_tokens"] and run_off["prefix_hit_tokens"] == 0
    equal = {"requests_compared": 24, "mismatched": 0, "equal": True, "first_mismatches": [],
             "first_differing_token_min_median": None}  # float32 on the CPU: the batches change no token
    assert shared["output_check"] == {**equal, "requests_compared": 48, "control_without_caching_run_again": equal}

    small = run_bench_serving(tmp_path, "--small-model", "--sampling")
    adapters, base = (small["systems"][name]["saturation"] for name in ("engine, 4 adapters", "engine, base model"))
    assert adapters["tokens"] == base["tokens"] > 0
    assert small["targets"]["base_tokens_per_second"] == base["tokens_per_second"]
    decode_summaries = [summary for steps in small["engine_steps"].values()
                        for summary in steps["decode_by_batch"].values()]
    assert decode_summaries and all(summary["median_device_ms"] is None for summary in decode_summaries)  # CUDA only

    default = run_bench_serving(tmp_path, "--requests", "8", "--rates", "0.5", "--static-requests", "0",
                                "--no-transformers-cb")
    assert [len(system["runs"]) for system in default["systems"].values()] == [1, 1, 1]


def test_serving_output_check_names_each_request_that_differs_and_where():
    from bench_serving import compare_outputs

    same = [[(1, 2, 3), (4, 5)]]
    assert compare_outputs(same, same)["equal"]
    check = compare_outputs([[(1, 2, 3), (4, 5)], [(6,)]], [[(1, 2, 3), (4, 5, 9)], [(7,)]])
    assert not check["equal"] and check["mismatched"] == 2 and check["requests_compared"] == 3
    assert check["first_mismatches"] == [{"run": 0, "request": 1, "first_differing_token": 2},
                                         {"run": 1, "request": 0, "first_differing_token": 0}]
    assert check["first_differing_token_min_median"] == [0, 2]


def test_step_floors_count_the_bytes_and_flops_of_the_models_shapes():
    """``floors``: the decode floor reads every parameter once (the input embedding table too, and the stricter
    floor without it; a tied table counted once) plus each key token's keys and values over every layer; the
    prefill floor multiplies every parameter but the input embedding, twice per token."""
    import floors

    untied = tiny_llama(num_hidden_layers=2, hidden_size=64, num_key_value_heads=2, head_dim=16,
                        tie_word_embeddings=False)
    vocab, hidden = untied.config.vocab_size, 64
    params = sum(p.numel() for p in untied.parameters())
    assert floors.parameter_bytes(untied) == (4 * params, 4 * vocab * hidden)
    assert floors.kv_bytes_per_token(untied) == 2 * 2 * 2 * 16 * 4  # K and V x layers x kv heads x head x fp32
    floor = floors.decode_bytes_floor(untied, key_tokens=1000, bandwidth=1e12)
    assert floor["floor_ms"] == pytest.approx(1e3 * (4 * params + 1000 * 512) / 1e12)
    assert floor["floor_ms_without_input_embeddings"] == pytest.approx(
        1e3 * (4 * params - 4 * vocab * hidden + 1000 * 512) / 1e12)
    prefill = floors.prefill_flop_floor(untied, tokens=2048, device_name="NVIDIA H200")
    assert prefill["floor_ms"] == pytest.approx(1e3 * 2 * (params - vocab * hidden) * 2048 / 989e12)
    assert floors.prefill_flop_floor(untied, tokens=2048, device_name="cpu") is None
    tied = tiny_llama(num_hidden_layers=2, hidden_size=64, tie_word_embeddings=True)
    assert floors.parameter_bytes(tied) == (4 * sum(p.numel() for p in tied.parameters()), 0)
    step = {"median_ms": 6.0, "median_device_ms": 3.0}
    assert floors.against_floor(step, {"floor_ms": 2.0})["ratio"] == 3.0
    assert floors.against_floor(step, {"floor_ms": 2.0})["device_ratio"] == 1.5
    assert floors.against_floor(step, None) is None


def test_profile_tells_a_tiled_calls_per_token_kernels_from_decode_sized_calls():
    """A split tiled call launches its tiled kernels, then its per-token shrink and expand (whose walking grid may
    be as small as a decode call's): those two count as the tiled call's, per-token kernels after anything else as
    decode-sized calls; another stream's kernels in between do not end a call."""
    names = ["nvjet_gemm", "shrink_tiled_kernel<bf16>", "expand_tiled_kernel<bf16>", "shrink_chunk_kernel<bf16, 1>",
             "expand_chunk_kernel<bf16, 1>", "shrink_chunk_kernel<bf16, 4>", "expand_chunk_kernel<bf16, 4>",
             "shrink_tiled_kernel<bf16>", "expand_tiled_kernel<bf16>", "rms_norm", "shrink_chunk_kernel<bf16, 1>",
             "paged_attention", "fused_chunk_kernel<bf16>"]
    events = [{"name": name, "ts": ts, "tid": 7} for ts, name in enumerate(names)]
    events.insert(3, {"name": "index_copy", "ts": 2.5, "tid": 9})  # a side stream's kernel between the halves
    events.sort(key=lambda e: (str(e["tid"]), e["ts"]))
    kinds = dict(zip(((e["tid"], e["ts"]) for e in events), kinds_of(events)))
    tiled, decode = "lora per-token, in tiled calls", "lora per-token, decode-sized calls"
    expected = ["gemm", "lora tiled", "lora tiled", tiled, tiled, decode, decode, "lora tiled", "lora tiled", "other",
                decode, "attention", decode]
    assert [kinds[(7, ts)] for ts in range(len(names))] == expected
    assert kinds[(9, 2.5)] == "other"
