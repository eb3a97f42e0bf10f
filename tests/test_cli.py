"""The ``punica-hf`` command line, run in-process through ``main([...])`` (and as ``python -m`` where the entry
point itself is the subject). Output goes to a non-terminal, as in CI, so live views print their final state."""

from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import save_peft_adapter, save_word_level_model, tiny_llama
from transformers import AutoModelForCausalLM, AutoTokenizer

from punica_hf import MultiLoraModel, demo
from punica_hf.cli import main
from punica_hf.formats import load_converted
from punica_hf.formats import load_adapter_weights
from punica_hf.cli.streaming import BatchStreamer

OPTIONS = {
    "demo": ["--device", "--dtype", "--debug"],
    "generate": [
        "--model", "--adapter", "--prompt", "--prompts-jsonl", "--max-new-tokens", "--do-sample", "--temperature",
        "--top-p", "--top-k", "--seed", "--max-rank", "--chat-template", "--device", "--dtype", "--tp", "--debug",
    ],
    "convert": ["SRC", "DST", "--dtype", "--base-model", "--revision", "--subfolder", "--cache-dir", "--debug"],
}
OPTIONS["dashboard"] = OPTIONS["generate"]


@pytest.fixture(autouse=True)
def wide_output(monkeypatch):
    """Rich wraps non-terminal output at 80 columns; wide enough rows keep each one on one line."""
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture(scope="module")
def demo_shaped_adapters(tmp_path_factory):
    """Random PEFT adapters for the demo base model, one per demo task name: ``{task: folder}``."""
    if not (demo.base_model_path() / "config.json").is_file():
        pytest.skip(f"the demo base model is not built yet ({demo.base_model_path()}; examples/train_demo_model.py)")
    folder = tmp_path_factory.mktemp("demo-adapters")
    base = demo.load_base_model()
    return {
        task: save_peft_adapter(base, folder / task, seed=seed, r=4, target_modules=["q_proj", "v_proj"])
        for seed, task in enumerate(demo.TASKS)
    }


def adapter_options(adapters: dict[str, Path]) -> list[str]:
    return [option for name, path in adapters.items() for option in ("--adapter", f"{name}={path}")]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ------------------------------------------------------------------------------------------------ help
@pytest.mark.parametrize("command", list(OPTIONS))
def test_help_of_each_command_explains_every_option(capsys, command):
    code, out, _ = run(capsys, command, "--help")
    assert code == 0
    for option in OPTIONS[command]:
        assert option in out, f"{command} --help does not mention {option}"
    assert "examples:" in out and f"punica-hf {command}" in out.split("examples:")[1]


def test_top_level_help_lists_every_command(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for command in OPTIONS:
        assert command in out


# ------------------------------------------------------------------------------------------------ errors
def test_error_is_one_line_without_traceback(capsys, tmp_path):
    missing = tmp_path / "no-such-adapter"
    code, out, err = run(capsys, "generate", "--model", "demo", "--adapter", f"a={missing}", "--prompt", "a:lora")
    assert code == 1
    assert err.strip().count("\n") == 0
    assert err.startswith("error: ") and str(missing) in err and "Traceback" not in err


def test_usage_error_is_one_line_with_code_2(capsys):
    code, _, err = run(capsys, "generate", "--model", "demo", "--adapter", "no-equals-sign", "--prompt", "base:x")
    assert code == 2
    assert err.strip().count("\n") == 0 and "expected NAME=PATH" in err


@pytest.mark.parametrize(
    "adapters, problem",
    [
        pytest.param(["base=./a"], "the name 'base' is reserved for the base model", id="reserved-name"),
        pytest.param(["x=./a", "y=./b", "x=./c"], "the name 'x' is given twice (./a and ./c)", id="twice"),
        pytest.param(["x=./a", "x=./a"], "the name 'x' is given twice (./a and ./a)", id="twice-same-path"),
        pytest.param(["a:b=./a"], "adapter names cannot hold ':'", id="colon"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "dashboard"])
def test_adapter_names_the_prompts_could_not_tell_apart_are_usage_errors(capsys, command, adapters, problem):
    """Refused by the parser, before anything loads: none of the paths exists, so a load would fail otherwise."""
    options = [option for adapter in adapters for option in ("--adapter", adapter)]
    code, out, err = run(capsys, command, "--model", "demo", *options, "--prompt", "base:lora")
    assert code == 2 and out == ""
    assert err.strip().count("\n") == 0 and f"argument --adapter: {problem}" in err


@pytest.mark.parametrize(
    "adapter, problem",
    [
        pytest.param("base=./a", "the name 'base' is reserved for the base model", id="reserved-name"),
        pytest.param("bad\x00name=./a", "the adapter name 'bad\\x00name' is not allowed", id="nul"),
        pytest.param("emoji-\U0001f600=./a", "is not allowed: use letters, digits", id="emoji"),
        pytest.param("a/b/c=./a", "'a/b/c' is not allowed", id="two-slashes"),
        pytest.param(f"{'x' * 97}=./a", "is not allowed", id="too-long"),
    ],
)
def test_serve_refuses_adapter_names_it_could_not_serve(capsys, adapter, problem):
    """Refused by the parser, before the port is bound or anything loads (none of the paths exists)."""
    code, out, err = run(capsys, "serve", "--model", "demo", "--adapter", adapter, "--port", "0")
    assert code == 2 and out == ""
    assert err.strip().count("\n") == 0 and "argument --adapter: " in err and problem in err


@pytest.mark.parametrize("command", ["serve", "generate"])
@pytest.mark.parametrize("kind", ["absolute", "relative", "home", "inside-a-folder", "a-file"])
def test_a_model_path_that_is_not_a_folder_says_so(capsys, tmp_path, monkeypatch, command, kind):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"")
    model, problem = {
        "absolute": (str(tmp_path / "missing"), "no such folder"),
        "relative": ("./missing", "no such folder"),
        "home": ("~/punica-hf-surely-missing-folder", "no such folder"),
        "inside-a-folder": ("models/missing", "no such folder"),
        "a-file": ("./weights.bin", "a file, not a model folder"),
    }[kind]
    extra = ["--port", "0"] if command == "serve" else ["--prompt", "base:hello"]
    code, _, err = run(capsys, command, "--model", model, *extra)
    assert code == 1 and err.strip().count("\n") == 0
    assert f"--model {model}: {problem}" in err and "repo" not in err.lower(), err


def test_prompt_for_an_adapter_that_is_not_loaded(capsys, demo_shaped_adapters):
    code, _, err = run(
        capsys, "generate", "--model", "demo", "--adapter", f"reverse={demo_shaped_adapters['reverse']}",
        "--prompt", "upper:lora",
    )
    assert code == 1 and "'upper'" in err and "no --adapter loads" in err


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_raises_the_error(tmp_path, where):
    command = ["generate", "--model", "demo", "--adapter", f"a={tmp_path / 'nope'}", "--prompt", "a:x"]
    argv = ["--debug", *command] if where == "before" else [*command, "--debug"]
    with pytest.raises(FileNotFoundError, match="nope"):
        main(argv)


def test_python_m_punica_hf_error_is_one_line(tmp_path):
    """The real entry point, end to end: one line on stderr, no traceback, exit code 1."""
    missing = tmp_path / "nope"
    command = ["generate", "--model", "demo", "--adapter", f"a={missing}", "--prompt", "a:x"]
    result = subprocess.run(
        [sys.executable, "-m", "punica_hf", *command],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: no adapter folder at {missing}; not a Hub repo id either (run with --debug for the traceback)"
    ]


# ------------------------------------------------------------------------------------------------ convert
def test_convert_one_adapter_to_a_file(capsys, demo_shaped_adapters, tmp_path):
    destination = tmp_path / "reverse-bf16.safetensors"
    code, out, _ = run(capsys, "convert", str(demo_shaped_adapters["reverse"]), str(destination), "--dtype", "bf16")
    assert code == 0 and str(destination) in out
    converted, original = load_converted(destination), load_adapter_weights(demo_shaped_adapters["reverse"])
    for name, factors in original.modules.items():
        assert torch.equal(converted.modules[name].lora_a, factors.lora_a.bfloat16().float())


def test_convert_refuses_clashing_names(capsys, demo_shaped_adapters, tmp_path):
    path = str(demo_shaped_adapters["sort"])
    code, _, err = run(capsys, "convert", path, path, str(tmp_path / "out"))
    assert code == 1 and "same file name: sort" in err
    assert not (tmp_path / "out").exists()


def test_convert_refuses_an_existing_output_unless_told_to_overwrite(capsys, demo_shaped_adapters, tmp_path):
    """An existing file at DST was replaced without a word (a source's own adapter_model.safetensors included)."""
    source = shutil.copytree(demo_shaped_adapters["sort"], tmp_path / "sort")
    own_weights = source / "adapter_model.safetensors"
    before = own_weights.read_bytes()
    code, _, err = run(capsys, "convert", str(source), str(own_weights))
    assert code == 1 and f"{own_weights} exist(s)" in err and "--overwrite" in err
    assert own_weights.read_bytes() == before
    other = tmp_path / "other.safetensors"
    other.write_text("not an adapter")
    assert run(capsys, "convert", str(source), str(other))[0] == 1 and other.read_text() == "not an adapter"
    assert run(capsys, "convert", str(source), str(other), "--overwrite")[0] == 0
    assert load_converted(other).modules.keys() == load_adapter_weights(source).modules.keys()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left


def test_convert_of_several_sources_writes_all_or_nothing(capsys, demo_shaped_adapters, tmp_path):
    """A bad source after good ones used to fail after the good ones' files were written."""
    no_adapter = tmp_path / "no_adapter"
    no_adapter.mkdir()
    destination = tmp_path / "out"
    code, _, err = run(capsys, "convert", str(demo_shaped_adapters["sort"]), str(demo_shaped_adapters["upper"]),
                       str(no_adapter), str(destination))
    assert code == 1 and "no_adapter" in err
    assert not destination.exists()  # made for this call, and removed again with nothing in it
    deep = destination / "deeper" / "file.safetensors"  # every folder made on the way, too
    assert run(capsys, "convert", str(no_adapter), str(deep))[0] == 1 and not destination.exists()
    destination.mkdir()
    (destination / "keep.txt").write_text("the user's")
    assert run(capsys, "convert", str(demo_shaped_adapters["sort"]), str(no_adapter), str(destination))[0] == 1
    assert sorted(p.name for p in destination.iterdir()) == ["keep.txt"]


def test_convert_names_the_file_of_the_current_folder_after_it(capsys, demo_shaped_adapters, tmp_path, monkeypatch):
    """``convert . DST/`` wrote DST/.safetensors, a hidden file no loader takes for an adapter."""
    monkeypatch.chdir(demo_shaped_adapters["upper"])
    assert run(capsys, "convert", ".", str(tmp_path))[0] == 0
    assert [p.name for p in tmp_path.iterdir()] == ["upper.safetensors"]
    hidden = shutil.copytree(demo_shaped_adapters["upper"], tmp_path / ".hidden")  # no name of its own to give ...
    code, _, err = run(capsys, "convert", str(hidden), str(tmp_path / "out"))
    assert code == 1 and "give DST as a file ending in .safetensors" in err
    assert run(capsys, "convert", str(hidden), str(tmp_path / "named.safetensors"))[0] == 0  # ... so DST names it


def test_convert_refuses_factors_the_dtype_cannot_hold(capsys, tmp_path):
    """fp16 holds at most 65504: a factor past it became inf, and the file was written though no load takes it."""
    base = tiny_llama()
    source = save_peft_adapter(base, tmp_path / "big", r=1, lora_alpha=1e6, target_modules=["q_proj"], seed=1)
    code, _, err = run(capsys, "convert", str(source), str(tmp_path / "big.safetensors"), "--dtype", "fp16")
    assert code == 1 and "beyond the range of torch.float16" in err and "fp32 or bf16" in err
    assert not (tmp_path / "big.safetensors").exists()
    assert run(capsys, "convert", str(source), str(tmp_path / "big.safetensors"), "--dtype", "fp32")[0] == 0


def test_python_m_punica_hf_convert(monkeypatch, demo_shaped_adapters, tmp_path):
    monkeypatch.setattr(sys, "argv", ["punica_hf", "convert", str(demo_shaped_adapters["upper"]), str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("punica_hf", run_name="__main__")
    assert exit_info.value.code == 0
    assert load_converted(tmp_path / "upper.safetensors").modules.keys() == (
        load_adapter_weights(demo_shaped_adapters["upper"]).modules.keys()
    )


# ------------------------------------------------------------------------------------------------ generation
def direct_answers(adapters: dict[str, Path], words: list[str], adapter_ids: list[str | None]) -> list[str]:
    """What the library itself answers (greedy, up to ``demo.MAX_ANSWER_TOKENS``), to compare the command line's
    output with."""
    model = MultiLoraModel(demo.load_base_model(), max_adapters=len(adapters))
    model.load_adapters(adapters)
    return demo.generate_answers(model, words, adapter_ids=adapter_ids)


def test_generate_with_the_demo_model(capsys, demo_shaped_adapters, tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"adapter": None, "prompt": "adapter"}) + "\n\n")
    code, out, err = run(
        capsys, "generate", "--model", "demo", *adapter_options(demo_shaped_adapters),
        "--prompt", "reverse:lora", "--prompt", "sort:punica", "--prompts-jsonl", str(requests),
        "--max-new-tokens", str(demo.MAX_ANSWER_TOKENS),
    )
    assert code == 0, err
    answers = direct_answers(demo_shaped_adapters, ["lora", "punica", "adapter"], ["reverse", "sort", None])
    lines = out.splitlines()
    for adapter, word, answer in zip(["reverse", "sort", "base"], ["lora", "punica", "adapter"], answers):
        assert any(f"│ {adapter} " in line and f"│ {word} " in line and f"│ {answer} " in line for line in lines)
    assert "3/3 rows done" in out


def test_demo_prompts_take_the_word_bare_or_as_the_demo_shows_it(capsys):
    """``punica-hf demo`` shows its prompts as "lora="; given so to ``generate`` they mean the word "lora"."""
    adapters = demo.adapter_paths()
    if not all(path.is_dir() for path in adapters.values()):
        pytest.skip("the demo adapters are not built yet (examples/train_demo_model.py writes punica_hf/demo/adapters)")
    prompts = ["reverse:lora=", "reverse:lora", "upper:adapter=", "base:punica="]
    code, out, err = run(
        capsys, "generate", "--model", "demo", *[option for p in prompts for option in ("--prompt", p)],
        "--max-new-tokens", str(demo.MAX_ANSWER_TOKENS),
    )
    assert code == 0, err
    answers = direct_answers(adapters, ["lora", "lora", "adapter", "punica"], ["reverse", "reverse", "upper", None])
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == len(prompts)
    for row, prompt, answer in zip(rows, prompts, answers):
        adapter, _, text = prompt.partition(":")
        assert f"│ {adapter} " in row and f"│ {text} " in row and f"│ {answer} " in row, row


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    """``(model folder, {name: PEFT folder})``: a tiny Llama saved with a word-level tokenizer ("w2".."w99",
    EOS "</s>" = 1, no pad token, a chat template "w7 TEXT w8"), as a Hub model would be, and one adapter."""
    return save_word_level_model(tmp_path_factory.mktemp("local-model"))


@pytest.mark.parametrize("chat_template", [False, True], ids=["plain", "chat-template"])
def test_generate_with_a_transformers_model_and_tokenizer(capsys, local_model, chat_template):
    model_path, adapters = local_model
    prompts = {"a": "w5 w6 w9", None: "w3"}
    code, out, err = run(
        capsys, "generate", "--model", str(model_path), *adapter_options(adapters), "--max-new-tokens", "5",
        *[option for adapter, text in prompts.items() for option in ("--prompt", f"{adapter or 'base'}:{text}")],
        *(["--chat-template"] if chat_template else []),
    )
    assert code == 0, err

    # the same batch through the library: left padding with EOS as the pad token, the template applied by hand
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    model = MultiLoraModel(AutoModelForCausalLM.from_pretrained(model_path), max_adapters=1, max_rank=4)
    model.load_adapters(adapters)
    texts = [f"w7 {text} w8" if chat_template else text for text in prompts.values()]
    assert tokenizer.pad_token is None  # so the command line had to supply one
    tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    output = model.generate(**batch, adapter_ids=list(prompts), max_new_tokens=5, do_sample=False, pad_token_id=1)
    answers = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    lines = out.splitlines()
    for (adapter, text), answer in zip(prompts.items(), answers):
        assert any(f"│ {adapter or 'base'} " in line and f"│ {text} " in line and f"│ {answer} " in line
                   for line in lines), f"no row for {adapter} with answer {answer!r} in:\n{out}"


def test_generate_refuses_a_prompt_without_tokens_by_name(capsys, local_model):
    """A prompt the tokenizer turns into no token failed inside the model with an error about tensor shapes."""
    model_path, adapters = local_model
    code, _, err = run(capsys, "generate", "--model", str(model_path), *adapter_options(adapters),
                       "--prompt", "a:w5", "--prompt", "a: ")
    assert code == 1 and "prompt 2 (' ', adapter a) has no tokens once tokenized" in err


@pytest.mark.parametrize("top_p", ["0", "2", "-0.5", "nan", "x"])
def test_generate_refuses_a_top_p_outside_zero_to_one(capsys, top_p):
    code, _, err = run(capsys, "generate", "--model", "demo", "--prompt", "upper:lora", "--do-sample", "--top-p", top_p)
    assert code == 2 and "expected a number in (0, 1]" in err


def test_generate_refuses_a_jsonl_file_that_is_not_utf8_naming_it(capsys, tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(b'{"adapter": null, "prompt": "ok"}\n{"prompt": "\xff"}\n')
    code, _, err = run(capsys, "generate", "--model", "demo", "--prompts-jsonl", str(requests))
    assert code == 1 and f"{requests}:2: not UTF-8 text" in err


def test_generate_refuses_a_bad_jsonl_line(capsys, tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"adapter": null, "prompt": "ok"}\n{"prompt": 3}\n')
    code, _, err = run(capsys, "generate", "--model", "demo", "--prompts-jsonl", str(requests))
    assert code == 1 and f"{requests}:2" in err


def test_batch_streamer_keeps_each_row_up_to_its_eos():
    ticks = iter([10.0, 11.0, 12.0, 14.0])  # prompts, step 1, step 2, end
    streamer = BatchStreamer(2, eos_token_ids={0, 9}, clock=lambda: next(ticks))
    streamer.put(torch.tensor([[5, 5, 5], [6, 6, 6]]))  # the prompts: not generated tokens
    streamer.put(torch.tensor([7, 9]))  # row 1 ends with EOS 9
    assert streamer.finished_at == [None, 11.0] and not streamer.done
    streamer.put(torch.tensor([8, 3]))  # row 1 is padded with 3 after it finished: ignored
    streamer.end()
    assert streamer.tokens == [[7, 8], []]
    assert streamer.finished_at == [14.0, 11.0] and streamer.done and streamer.steps == 2
    assert streamer.tokens_per_second(0) == 2 / 4.0
    assert streamer.tokens_per_second() == 2 / 4.0  # the batch's tokens over its whole time


def test_batch_streamer_gets_every_step_of_every_row(demo_shaped_adapters):
    model = MultiLoraModel(demo.load_base_model(), max_adapters=3, max_rank=4)
    model.load_adapters(demo_shaped_adapters)
    words, adapter_ids = ["lora", "adapter", "punica"], ["reverse", None, "upper"]
    input_ids, attention_mask = demo.batch_prompts(words)
    snapshots = []
    streamer = BatchStreamer(len(words), {demo.EOS_ID})
    streamer.on_update = lambda: snapshots.append([len(tokens) for tokens in streamer.tokens])
    output = model.generate(
        input_ids, attention_mask=attention_mask, adapter_ids=adapter_ids, streamer=streamer,
        max_new_tokens=10, do_sample=False, pad_token_id=demo.PAD_ID, eos_token_id=demo.EOS_ID,
    )
    new_tokens = output[:, input_ids.shape[1]:]
    assert streamer.done and streamer.steps == new_tokens.shape[1]
    assert [demo.decode(tokens) for tokens in streamer.tokens] == [demo.decode(row) for row in new_tokens]
    assert snapshots[0] == [1, 1, 1] and len(snapshots) == streamer.steps + 1  # one update a step, one at the end
    assert all(streamer.tokens_per_second(row) > 0 for row in range(len(words)))


def test_dashboard_runs_to_completion_without_a_terminal(capsys, demo_shaped_adapters):
    code, out, err = run(
        capsys, "dashboard", *adapter_options(demo_shaped_adapters), "--max-new-tokens", str(demo.MAX_ANSWER_TOKENS)
    )
    assert code == 0, err
    words = next(iter(demo.TASKS.values())).examples
    rows = [(adapter, word) for adapter in [*demo.TASKS, None] for word in words]
    answers = direct_answers(demo_shaped_adapters, [w for _, w in rows], [a for a, _ in rows])
    for row, ((adapter, _), answer) in enumerate(zip(rows, answers)):
        assert f"#{row} {adapter or 'base'}" in out
        assert f"→ {answer}" in out
    assert f"{len(rows)}/{len(rows)} rows done" in out and "tok/s overall" in out


def test_demo_prints_every_task(capsys):
    adapters = demo.adapter_paths()
    if not all(path.is_dir() for path in adapters.values()):
        pytest.skip("the demo adapters are not built yet (examples/train_demo_model.py writes punica_hf/demo/adapters)")
    code, out, err = run(capsys, "demo", "--device", "cpu")
    assert code == 0, err
    tasks = list(demo.TASKS)
    words = [demo.TASKS[task].examples[i % len(demo.TASKS[task].examples)] for i, task in enumerate(tasks)]
    answers = direct_answers(adapters, words, tasks)
    lines = out.splitlines()
    for task, word, answer in zip(tasks, words, answers):
        assert any(f"│ {demo.make_prompt(word)} " in line and f"│ {task} " in line and f"│ {answer} " in line
                   for line in lines), f"no row for {task}"
    assert any("│ base " in line for line in lines)


@pytest.mark.parametrize("options, ray", [
    ([], False),
    (["--replicas", "1"], True),  # one replica that Ray restarts and routes to
    (["--replicas", "3"], True),
    (["--ray-address", "10.0.0.1:6379"], True),
])
def test_replicas_on_ray_serve_whenever_replicas_or_a_cluster_is_named(options, ray):
    from punica_hf.cli import build_parser
    from punica_hf.cli.serve import on_ray

    args = build_parser().parse_args(["serve", "--model", "demo", *options])
    assert on_ray(args) is ray


def test_serve_engine_options_reach_the_engine_config():
    """``punica-hf serve``'s engine options become the engine's settings (the demo model: nothing to download)."""
    from punica_hf.cli import build_parser
    from punica_hf.cli.serve import make_engine

    def config_of(*options):
        args = build_parser().parse_args(["serve", "--model", "demo", "--device", "cpu", *options])
        return make_engine(args).config

    default = config_of()
    assert default.prefix_caching and not default.compile_steps and default.cuda_graphs is None
    chosen = config_of("--prefix-caching", "off", "--compile-steps", "on", "--cuda-graphs", "off", "--max-running", "3")
    assert (chosen.prefix_caching, chosen.compile_steps, chosen.cuda_graphs) == (False, True, False)
    assert chosen.max_running == 3
