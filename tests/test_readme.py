"""The README's claims, checked on the CPU path: what it shows is what the code does and what the results say.

Each test reads README.md (or benchmarks/README.md) as a user would and compares one kind of claim with the
running code or the results files: the two commands, the demo's printed table, the demo quickstart's output, the
paths and commands named, the refused OpenAI fields, the demo model's size and accuracy, the adapter memory
arithmetic and the performance table.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS_README = ROOT / "benchmarks" / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
CAPTION = re.compile(r"^\s*(\d+) rows in (\d+\.\d\d) s on (\S+) \(LoRA ops: (\w+)\)\s*$")


# ------------------------------------------------------------------------------------------------ reading
def readme() -> str:
    return README.read_text(encoding="utf-8")


def section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section (up to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README has no section '## {heading}'"
    return match.group(1)


def fenced_blocks(text: str, language: str | None = None) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if language is None or lang == language]


def without_fences(text: str) -> str:
    return FENCE.sub("", text)


def commands_in(block: str) -> list[str]:
    """The commands of a shell block: its lines without comments, blank lines left out."""
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", COLUMNS="100", **extra)
    return env


def table_rows(text: str, first_cell_start: str = "") -> list[list[str]]:
    """Cells of the Markdown table rows in ``text`` (header and rule left out)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not set(line) <= set("|-: "):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if cells[0].startswith(first_cell_start):
                rows.append(cells)
    return rows[1:] if rows and not first_cell_start else rows


# ------------------------------------------------------------------------------------------------ tests
def test_the_two_commands_are_exactly_two():
    blocks = fenced_blocks(section(readme(), "The two commands"))
    assert len(blocks) == 1, "the section shows one block"
    assert commands_in(blocks[0]) == ["make demo", "make test"]


def test_demo_output_shown_is_what_punica_hf_demo_prints_on_cpu():
    shown = next((block for block in fenced_blocks(readme()) if block.startswith("$ punica-hf demo\n")), None)
    assert shown is not None, "README shows no `$ punica-hf demo` output"
    script = Path(sys.executable).with_name("punica-hf")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "punica_hf"]
    result = subprocess.run([*command, "demo", "--device", "cpu"], capture_output=True, text=True, timeout=300,
                            env=subprocess_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]

    def normalized(lines: list[str]) -> list[str]:
        out = []
        for line in lines:
            caption = CAPTION.match(line)
            out.append(CAPTION.sub(r"\1 rows in T s on \3 (LoRA ops: \4)", line).strip() if caption else line.rstrip())
        while out and not out[-1]:
            out.pop()
        return out

    shown_lines = shown.splitlines()[1:]
    assert any(CAPTION.match(line) for line in shown_lines), "the shown output has no timing line"
    assert normalized(result.stdout.splitlines()) == normalized(shown_lines)
    assert "✗" not in result.stdout


def test_demo_quickstart_runs_offline_and_prints_what_its_comments_say(tmp_path):
    block = fenced_blocks(section(readme(), "Quickstart on the demo model"), "python")
    assert len(block) == 1
    code = block[0]
    expected = [match.group(1) for match in re.finditer(r"^print\(.*\)\s+# (.*)$", code, re.M)]
    assert expected, "the quickstart prints nothing to compare"
    (tmp_path / "quickstart.py").write_text(code)
    # an empty Hugging Face home: nothing can come from a cache or the network
    env = subprocess_env(HF_HOME=str(tmp_path / "hf_home"))
    result = subprocess.run([sys.executable, "quickstart.py"], capture_output=True, text=True, timeout=300,
                            env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == expected


def test_demo_model_size_and_accuracy_are_as_stated():
    from punica_hf import demo

    text = " ".join(readme().split())
    parameters = sum(p.numel() for p in demo.load_base_model().parameters())
    assert f"{parameters / 1e6:.1f} M parameters" in text
    report = json.loads((demo.demo_dir() / "ACCURACY.json").read_text())
    assert f"On {report['held_out_words_per_task']} held-out words per task" in text
    tasks = list(demo.TASKS)

    def percent(value: float) -> str:
        return f"{value * 100:g} %"

    own = [f"{percent(report['accuracy'][task][task])} ({task})" for task in tasks]
    assert f"at {', '.join(own[:-1])} and {own[-1]}" in text
    base = [percent(report["accuracy"]["base"][task]) for task in tasks]
    assert f"the base model alone at {', '.join(base[:-1])} and {base[-1]}" in text


def path_tokens(text: str) -> list[str]:
    """Words inside inline code spans (outside code blocks) that contain a slash."""
    words = []
    for span in re.findall(r"`([^`\n]+)`", without_fences(text)):
        words += [word.strip("\"'(),;:") for word in span.split() if "/" in word]
    return words


def existing(token: str, bases: list[Path]) -> bool:
    """Whether ``token`` names something in one of ``bases`` ({a,b} alternatives and * globs allowed)."""
    braces = re.match(r"(.*)\{([^}]*)\}(.*)", token)
    if braces:
        return all(existing(braces.group(1) + part + braces.group(3), bases) for part in braces.group(2).split(","))
    return any(glob.glob(str(base / token)) for base in bases)


@pytest.mark.parametrize("readme_path", [README, BENCHMARKS_README], ids=["README", "benchmarks-README"])
def test_every_path_and_link_named_exists(readme_path):
    text = readme_path.read_text(encoding="utf-8")
    bases = [readme_path.parent] if readme_path.parent == ROOT else [readme_path.parent, ROOT]
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):  # Markdown links
        if "://" not in target and not target.startswith("#"):
            if not (readme_path.parent / target.split("#")[0]).exists():
                missing.append(target)
    top_level = {entry.name for base in bases for entry in base.iterdir()}
    checked = 0
    for token in path_tokens(text):
        if token.startswith(("$", "~", "/")) or "://" in token or token.split("/")[0] not in top_level:
            continue  # environment variables, home folders, URL paths, Hub ids
        checked += 1
        if not existing(token, bases):
            missing.append(token)
    assert checked >= 5, "no paths found: the check would pass on any README"
    assert not missing, f"{readme_path.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_every_python_module_run_with_dash_m_exists():
    modules = set(re.findall(r"python -m ([\w.]+)", readme()))
    assert "punica_hf.ops.build" in modules
    assert [module for module in sorted(modules) if importlib.util.find_spec(module) is None] == []


def test_every_punica_hf_command_named_exists_and_every_command_is_in_the_table():
    from punica_hf.cli import build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    commands = set(subparsers.choices)
    named = set(re.findall(r"punica-hf ([a-z][\w-]*)", readme()))
    assert named - commands == set(), "README names commands that do not exist"
    table = {re.match(r"`punica-hf ([\w-]+)", row[0]).group(1)
             for row in table_rows(section(readme(), "Command line"), "`punica-hf ")}
    assert table == commands


NON_NEUTRAL_CANDIDATES = (2, True, 0.5, "x", {"1": 1.0}, [1], ["x"], [{"type": "function"}])


def refused_fields(request_class, required: dict) -> set[str]:
    """The fields ``request_class`` refuses by name at some value (probed one field at a time)."""
    from pydantic import ValidationError

    refused = set()
    for name in set(request_class.model_fields) - set(required):
        for value in NON_NEUTRAL_CANDIDATES:
            try:
                request_class(**required, **{name: value})
            except ValidationError as error:
                message = re.search(r"not supported by this server: ([\w, ]+)", str(error))
                if message and name in [named.strip() for named in message.group(1).split(",")]:
                    refused.add(name)
                    break
    return refused


def test_refused_openai_fields_are_the_ones_the_server_refuses():
    from punica_hf.serving.protocol import ChatCompletionRequest, CompletionRequest

    serving = section(readme(), "Serving")
    table = serving.split("**Refused fields.**", 1)[1].split("\n\n")[1]
    rows = {row[0].strip("`"): row[1] for row in table_rows(table, "`")}
    assert rows and set(rows.values()) <= {"both", "completions", "chat"}, rows
    completions = refused_fields(CompletionRequest, {"model": "m", "prompt": "p"})
    chat = refused_fields(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert {"n", "logprobs", "echo"} <= completions  # the probe finds what it should
    assert {field for field, where in rows.items() if where in ("both", "completions")} == completions
    assert {field for field, where in rows.items() if where in ("both", "chat")} == chat


def test_adapter_memory_figures_follow_from_the_llama_3_8b_shape():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from punica_hf.store.pool import aligned
    from punica_hf.store.store import GPU_POOL_FRACTION

    text = " ".join(readme().split())
    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    projections = [m for name, m in model.named_modules() if name.startswith("model.layers.0.")
                   and isinstance(m, torch.nn.Linear)]
    assert len(projections) == 7
    per_rank = sum(m.in_features + m.out_features for m in projections)  # elements per rank per layer
    assert all(aligned(16 * m.in_features) == 16 * m.in_features for m in projections)  # no alignment padding
    rank16 = 16 * per_rank * 32 * 2
    assert f"`16 x {per_rank:,} x 32 layers x 2 bytes` = {rank16 / 1e6:.0f} MB" in text
    default_pool = 64 * 64 * per_rank * 32 * 2
    assert f"(64, 64) that is {default_pool / 1e9:.1f} GB, or about {default_pool // rank16} resident" in text
    assert f"capped at {GPU_POOL_FRACTION:.0%} of the GPU memory free" in text


def test_performance_table_matches_the_results_files():
    performance = section(readme(), "Performance")
    rows = {row[0]: row[1] for row in table_rows(performance)}

    def row(start: str) -> str:
        found = [result for what, result in rows.items() if what.startswith(start)]
        assert len(found) == 1, f"one row starting {start!r}, found {len(found)}"
        return found[0]

    generate = json.loads((RESULTS / "bench_generate_h200.json").read_text())
    environment, ratios = generate["environment"], generate["ratios"]
    assert environment["gpu"] in performance
    for package in ("torch", "transformers", "peft"):
        assert f"{package} {'.'.join(environment[package].split('.')[:2])}" in performance
    for mode in ("compiled", "eager"):
        shown = " / ".join(f"{ratios[f'punica_hf, {n} distinct, {mode}, decode']:.2f}" for n in (1, 8, 32))
        assert shown in row(f"`generate()`, {'static cache + compiled' if mode == 'compiled' else 'eager'}")
    peft = row("`generate()`, eager")
    assert f"PEFT: {ratios['PEFT, one adapter active, eager, decode']:.2f} with one adapter" in peft
    assert f"{ratios['PEFT mixed batch (adapter_names), 32 distinct, eager, decode']:.2f} with 32" in peft

    serving = json.loads((RESULTS / "bench_serving_h200.json").read_text())
    ours, base = (serving["systems"][name]["saturation"] for name in ("engine, 32 adapters", "engine, base model"))
    transformers_cb = serving["transformers_continuous_batching"]["tokens_per_second"]
    assert (f"{ours['tokens_per_second']:.0f} tokens/s: "
            f"{ours['tokens_per_second'] / base['tokens_per_second']:.2f} x the same engine on the base model "
            f"({base['tokens_per_second']:.0f}), {ours['tokens_per_second'] / transformers_cb:.2f} x transformers' "
            f"continuous batching on the base model with its defaults ({transformers_cb:.0f}); median time to first "
            f"token {ours['ttft_p50']:.2f} s") in row("serving, 32 adapters, 160 requests")
    steps = [serving["targets"][f"decode_step_vs_compiled_generate_at_{batch}"] for batch in (32, 128)]
    assert (" / ".join(f"{step['engine_ms']:.1f}" for step in steps) + " ms: "
            + " / ".join(f"{step['ratio']:.2f}" for step in steps) + " x the compiled static-cache `generate()` step ("
            + " / ".join(f"{step['compiled_generate_ms']:.1f}" for step in steps) + " ms)"
            ) in row("serving, decode step at 32 / 128")
    (half,) = [run for run in serving["systems"]["engine, 32 adapters"]["runs"] if run["fraction_of_saturation"] == 0.5]
    assert (f"{half['tokens_per_second']:.0f} tokens/s; p99 time to first token {half['ttft_p99']:.2f} s, "
            f"p99 per-token {half['tpot_p99'] * 1e3:.0f} ms") in row("serving, 32 adapters, Poisson")
    assert serving["device"] in performance and "bench_serving_h200.png" in performance

    kernels = [r for r in json.loads((RESULTS / "bench_ops_h200.json").read_text())["results"] if "best_peer" in r]
    groups = {
        "LoRA kernel time against the best peer: rank 16, decode, distinct":
            lambda r: r["rank"] == 16 and r["case"].startswith("distinct"),
        "same, rank 16, decode, 8 or 1 adapters shared":
            lambda r: r["rank"] == 16 and r["case"] in ("8 adapters 64", "1 adapter 64"),
        "same, prefill": lambda r: r["case"].startswith("prefill"),
        "same, rank 64, decode": lambda r: r["rank"] == 64 and not r["case"].startswith("prefill"),
    }
    assert sum(len([r for r in kernels if chosen(r)]) for chosen in groups.values()) == len(kernels)
    for start, chosen in groups.items():
        group = [r for r in kernels if chosen(r)]
        shown = row(start)
        assert f"{min(r['ratio'] for r in group):.2f}-{max(r['ratio'] for r in group):.2f} x" in shown
        peers = {r["best_peer"] for r in group}
        if len(peers) == 1:
            assert f"({peers.pop()})" in shown


def test_benchmarks_readme_describes_every_script():
    text = BENCHMARKS_README.read_text(encoding="utf-8")
    scripts = [p for p in (ROOT / "benchmarks").rglob("*") if p.suffix in (".py", ".sh")]
    assert scripts
    described = {cells[0].strip("`") for cells in table_rows(text)}
    assert {p.relative_to(ROOT / "benchmarks").as_posix() for p in scripts} <= described
    assert "](KERNEL_NOTES.md)" in text


def test_ci_runs_the_test_command_the_readme_prints():
    """.ci/run calls the README's test command as printed, then the lowest transformers of the pin."""
    test_command = commands_in(fenced_blocks(section(readme(), "The two commands"))[0])[1]
    ci = commands_in((ROOT / ".ci" / "run").read_text())
    assert test_command in ci
    tests = " ".join(section(readme(), "Tests").split())
    assert f"`.ci/run` runs `{test_command}` on a clean clone" in tests
    assert any("transformers==$lowest" in line for line in ci), "CI also tests the lowest transformers of the pin"


def test_make_targets_are_the_two_commands():
    """The Makefile defines what the two commands run: the demo, and pytest in the venv it sets up."""
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo: .*\n\t\$\(VENV\)/bin/punica-hf demo$", makefile, re.M)
    assert re.search(r"^test: .*\n\t\$\(VENV\)/bin/python -m pytest", makefile, re.M)
