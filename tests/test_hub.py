"""Loading adapters by Hub repo id through huggingface_hub, offline, from a Hub cache laid out by the test.

The cache follows huggingface_hub's layout (checked against ``scan_cache_dir`` / ``try_to_load_from_cache``):
``models--{org}--{name}/blobs/<sha256>``, ``refs/<branch or tag>`` holding a commit hash, and
``snapshots/<commit>/<path>`` symlinks into ``blobs``. The session runs with ``HF_HUB_OFFLINE=1`` (conftest), so
``hf_hub_download`` answers from this cache only. Each loaded adapter is compared with PEFT's
``PeftModel.from_pretrained`` on the same adapter's local folder.
"""

from __future__ import annotations

import copy
import hashlib
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
import pytest
import torch
from helpers import assert_state_unchanged, capture_state, save_peft_adapter, tiny_llama
from huggingface_hub import constants, scan_cache_dir, try_to_load_from_cache
from peft import PeftModel
from safetensors.torch import load_file

from punica_hf import MultiLoraModel, load_adapter_weights
from punica_hf.formats import load_converted

REPO = "punica-test/tiny-lora"
LEGACY_REPO = "punica-test/tiny-lora-bin"
NO_WEIGHTS_REPO = "punica-test/config-only"
SUBFOLDER = "adapters/extra"
COMMIT_1 = hashlib.sha1(b"commit 1").hexdigest()  # refs/main
COMMIT_2 = hashlib.sha1(b"commit 2").hexdigest()  # refs/v2 (a tag) and refs/dev (a branch)
INPUT_IDS = torch.tensor([[5, 17, 42, 8, 99, 3], [1, 2, 3, 4, 5, 6], [60, 61, 62, 63, 64, 65]])
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...] = ()) -> Path:
    """Put ``files`` ({path in repo: content}) into ``cache`` as snapshot ``commit`` of ``repo_id``."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for path_in_repo, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        pointer = repo / "snapshots" / commit / path_in_repo
        pointer.parent.mkdir(parents=True, exist_ok=True)
        pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no trailing newline, as huggingface_hub writes it
    return repo


def folder_files(folder: Path, prefix: str = "", names=ADAPTER_FILES) -> dict[str, bytes]:
    return {f"{prefix}{name}": (folder / name).read_bytes() for name in names}


@dataclass(frozen=True)
class Hub:
    cache: Path
    base: torch.nn.Module
    local: dict[str, Path]  # the local PEFT folders the cache was filled from
    peft_logits: dict[str, torch.Tensor]  # PeftModel.from_pretrained(base copy, local folder) on INPUT_IDS


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Hub:
    base = tiny_llama()
    root = tmp_path_factory.mktemp("adapters")
    local = {
        "main": save_peft_adapter(base, root / "main", seed=1, r=4, target_modules=["q_proj", "v_proj"]),
        "v2": save_peft_adapter(base, root / "v2", seed=2, r=8, lora_alpha=16, target_modules=["k_proj", "o_proj"]),
        "sub": save_peft_adapter(base, root / "sub", seed=3, r=2, target_modules=["up_proj", "down_proj"]),
    }
    legacy = root / "legacy"
    legacy.mkdir()
    shutil.copy(local["main"] / "adapter_config.json", legacy)
    torch.save(load_file(local["main"] / "adapter_model.safetensors"), legacy / "adapter_model.bin")

    cache = tmp_path_factory.mktemp("hub-cache")
    add_snapshot(
        cache, REPO, COMMIT_1,
        {**folder_files(local["main"]), **folder_files(local["sub"], prefix=SUBFOLDER + "/")}, refs=("main",),
    )
    add_snapshot(cache, REPO, COMMIT_2, folder_files(local["v2"]), refs=("v2", "dev"))
    add_snapshot(cache, LEGACY_REPO, COMMIT_1, folder_files(legacy, names=("adapter_config.json", "adapter_model.bin")),
                 refs=("main",))
    add_snapshot(cache, NO_WEIGHTS_REPO, COMMIT_1, folder_files(local["main"], names=("adapter_config.json",)),
                 refs=("main",))

    peft_logits = {}
    for key, folder in local.items():
        with torch.no_grad():
            peft_logits[key] = PeftModel.from_pretrained(copy.deepcopy(base), folder).eval()(INPUT_IDS).logits
        base_logits = base(INPUT_IDS).logits
    # the adapters must tell apart from each other and from the base model, or the tests would prove nothing
    distinct = [base_logits, *peft_logits.values()]
    for i, first in enumerate(distinct):
        for second in distinct[i + 1 :]:
            assert (first - second).abs().max() > 1e-3
    return Hub(cache=cache, base=base, local=local, peft_logits=peft_logits)


@pytest.fixture
def served(hub) -> MultiLoraModel:
    return MultiLoraModel(copy.deepcopy(hub.base), max_adapters=3, max_rank=8)


def logits_of(model: MultiLoraModel, adapter: str) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUT_IDS, adapter_ids=[adapter] * INPUT_IDS.shape[0]).logits


def assert_matches_peft(model: MultiLoraModel, adapter: str, hub: Hub, key: str) -> None:
    torch.testing.assert_close(logits_of(model, adapter), hub.peft_logits[key], rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------- the test setup
def test_the_session_is_offline():
    assert constants.HF_HUB_OFFLINE, "conftest must set HF_HUB_OFFLINE before huggingface_hub is imported"
    assert huggingface_hub.is_offline_mode()


def test_the_fixture_is_a_cache_huggingface_hub_recognises(hub):
    repos = {repo.repo_id: repo for repo in scan_cache_dir(hub.cache).repos}
    assert set(repos) == {REPO, LEGACY_REPO, NO_WEIGHTS_REPO}
    assert {ref: revision.commit_hash for ref, revision in repos[REPO].refs.items()} == {
        "main": COMMIT_1, "v2": COMMIT_2, "dev": COMMIT_2,
    }
    cached = try_to_load_from_cache(REPO, "adapter_config.json", cache_dir=hub.cache, revision="v2")
    assert Path(cached) == hub.cache / f"models--{REPO.replace('/', '--')}/snapshots/{COMMIT_2}/adapter_config.json"
    assert Path(cached).read_bytes() == (hub.local["v2"] / "adapter_config.json").read_bytes()


# ----------------------------------------------------------------------------------------------- loading
def test_load_by_repo_id_matches_peft(served, hub):
    assert served.load_adapters({"hub": REPO}, cache_dir=hub.cache) == {"hub": 0}
    assert_matches_peft(served, "hub", hub, "main")


def test_hub_and_local_loads_give_the_same_slots(served, hub):
    served.load_adapters({"hub": REPO}, cache_dir=str(hub.cache))
    served.load_adapters({"local": hub.local["main"]})
    for layer in (m for m in served.model.modules() if hasattr(m, "lora_ranks")):
        assert torch.equal(layer.lora_a_stacked[0], layer.lora_a_stacked[1])
        assert torch.equal(layer.lora_b_stacked[0], layer.lora_b_stacked[1])
        assert layer.lora_ranks[0] == layer.lora_ranks[1]


@pytest.mark.parametrize(
    "revision, expected",
    [
        pytest.param("v2", "v2", id="tag"),
        pytest.param("dev", "v2", id="branch"),
        pytest.param(COMMIT_2, "v2", id="commit-hash"),
        pytest.param(COMMIT_1, "main", id="commit-hash-of-main"),
        pytest.param("main", "main", id="main"),
    ],
)
def test_revision(served, hub, revision, expected):
    served.load_adapters({"x": REPO}, revision=revision, cache_dir=hub.cache)
    assert_matches_peft(served, "x", hub, expected)


def test_two_revisions_of_one_repo_side_by_side(served, hub):
    served.load_adapters({"old": REPO}, cache_dir=hub.cache)
    served.load_adapters({"new": REPO}, revision="v2", cache_dir=hub.cache)
    with torch.no_grad():
        logits = served(INPUT_IDS, adapter_ids=["old", "new", None]).logits
        base_logits = hub.base(INPUT_IDS).logits
    torch.testing.assert_close(logits[0], hub.peft_logits["main"][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[1], hub.peft_logits["v2"][1], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[2], base_logits[2], rtol=0, atol=1e-5)


def test_subfolder(served, hub):
    served.load_adapters({"sub": REPO}, subfolder=SUBFOLDER, cache_dir=hub.cache)
    assert_matches_peft(served, "sub", hub, "sub")


def test_repo_with_only_a_legacy_bin(served, hub):
    served.load_adapters({"legacy": LEGACY_REPO}, cache_dir=hub.cache)
    assert_matches_peft(served, "legacy", hub, "main")


def test_default_cache_is_used_without_cache_dir(served, hub, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub.cache))
    served.load_adapters({"hub": REPO})
    assert_matches_peft(served, "hub", hub, "main")


# ---------------------------------------------------------------------------------------------- failures
@pytest.fixture
def unchanged(served, hub):
    """``served`` with the "main" adapter loaded; asserts after the test body that nothing changed."""
    served.load_adapters({"main": REPO}, cache_dir=hub.cache)
    before = capture_state(served, INPUT_IDS, ["main", None, "main"])
    yield served
    assert_state_unchanged(served, before)


@pytest.mark.parametrize(
    "repo_id, options, local",
    [
        pytest.param("punica-test/not-cached", {}, "./punica-test/not-cached", id="unknown-repo"),
        pytest.param("not-cached", {}, "./not-cached", id="unknown-repo-without-org"),
        pytest.param(REPO, {"revision": "no-such-tag"}, f"./{REPO}", id="unknown-revision"),
        pytest.param(REPO, {"revision": hashlib.sha1(b"other").hexdigest()}, f"./{REPO}", id="uncached-commit"),
        pytest.param(REPO, {"subfolder": "no/such/folder"}, f"./{REPO}/no/such/folder", id="unknown-subfolder"),
    ],
)
def test_repo_not_in_the_cache(unchanged, hub, repo_id, options, local):
    problem = (
        f"no local folder {local}, and getting adapter_config.json of Hub repo '{repo_id}' failed: HF_HUB_OFFLINE "
        "is set and the Hugging Face cache has no copy of it"
    )
    with pytest.raises(FileNotFoundError, match=re.escape(problem)):
        unchanged.load_adapters({"x": repo_id}, cache_dir=hub.cache, **options)


def test_cached_repo_without_weights(unchanged, hub):
    with pytest.raises(FileNotFoundError, match=f"'{NO_WEIGHTS_REPO}' has neither adapter_model.safetensors nor"):
        unchanged.load_adapters({"x": NO_WEIGHTS_REPO}, cache_dir=hub.cache)


@pytest.mark.parametrize("source", ["org/bad name!", "a/b/c", "./not-here", "-leading-dash"])
def test_a_source_that_is_no_repo_id_is_not_looked_up_on_the_hub(unchanged, hub, monkeypatch, source):
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", _must_not_be_called)
    with pytest.raises(FileNotFoundError, match=re.escape(f"no adapter folder at {Path(source)}; not a Hub repo id")):
        unchanged.load_adapters({"x": source}, cache_dir=hub.cache)


def _must_not_be_called(*args, **kwargs):
    raise AssertionError("the Hub was asked")


def test_a_file_is_not_taken_for_an_adapter_folder(unchanged, hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(hub.local["main"] / "adapter_config.json", tmp_path)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", _must_not_be_called)
    with pytest.raises(FileNotFoundError, match="adapter_config.json is a file, not a PEFT adapter folder"):
        unchanged.load_adapters({"x": "adapter_config.json"}, cache_dir=hub.cache)


def test_a_missing_repo_leaves_the_cached_one_of_the_same_call_unloaded(unchanged, hub):
    with pytest.raises(OSError, match="punica-test/not-cached"):
        unchanged.load_adapters({"good": REPO, "bad": "punica-test/not-cached"}, revision="v2", cache_dir=hub.cache)
    assert "good" not in unchanged.adapters


# ----------------------------------------------------------------------------- a mistyped local folder
def test_a_mistyped_local_folder_says_both_where_it_looked(unchanged, hub, tmp_path, monkeypatch):
    """``sql-lora`` has the shape of a Hub repo id, so the Hub is asked too; the error tells both answers."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as error:
        unchanged.load_adapters({"sql": "sql-lora"}, cache_dir=hub.cache)
    assert str(error.value).startswith("no local folder ./sql-lora, and getting adapter_config.json of Hub repo")
    assert "HF_HUB_OFFLINE is set" in str(error.value)


# Run in a fresh interpreter: huggingface_hub reads HF_HUB_OFFLINE and HF_ENDPOINT once, at import. Prints the
# error (or "loaded") and the seconds the call took, on two lines.
_LOAD_IN_A_SUBPROCESS = textwrap.dedent(
    """
    import sys, time
    from punica_hf.formats import convert_adapter
    start = time.perf_counter()
    try:
        convert_adapter(sys.argv[1], sys.argv[2], cache_dir=sys.argv[3])
        print("loaded")
    except Exception as error:
        print(f"{type(error).__name__}: {error}".replace(chr(10), " "))
    print(time.perf_counter() - start)
    """
)
# The Hub as a machine without network sees it: nothing listens on the discard port.
UNREACHABLE_HUB = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
# huggingface_hub 2.x retries a failed request for about 23 s when nothing is cached; a few seconds is the promise.
FEW_SECONDS = 10


def load_in_a_subprocess(source: str, hub: Hub, tmp_path: Path, env: dict[str, str]) -> tuple[str, float]:
    """``(outcome, seconds)`` of converting ``source`` (read through ``hub.cache``) in a fresh interpreter."""
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_IN_A_SUBPROCESS, source, str(tmp_path / "out.safetensors"), str(hub.cache)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "OMP_NUM_THREADS": "1", **env},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome, seconds = result.stdout.strip().splitlines()[-2:]
    return outcome, float(seconds)


@pytest.mark.parametrize(
    "env", [pytest.param({"HF_HUB_OFFLINE": "1"}, id="offline"), pytest.param(UNREACHABLE_HUB, id="unreachable")]
)
def test_a_mistyped_local_folder_fails_within_seconds_without_the_hub(hub, tmp_path, env):
    outcome, seconds = load_in_a_subprocess("sql-lora", hub, tmp_path, env)
    assert outcome.startswith(
        "FileNotFoundError: no local folder ./sql-lora, and getting adapter_config.json of Hub repo 'sql-lora' failed: "
    )
    hub_said = outcome.partition("failed: ")[2]
    if "HF_ENDPOINT" in env:
        assert "Connect" in hub_said  # the network error itself, e.g. "ConnectError: [Errno 111] Connection refused"
    else:
        assert hub_said == "HF_HUB_OFFLINE is set and the Hugging Face cache has no copy of it"
    assert seconds < FEW_SECONDS


@pytest.mark.parametrize("repo_id", [REPO, LEGACY_REPO])
def test_a_cached_repo_loads_within_seconds_while_the_hub_is_unreachable(hub, tmp_path, repo_id):
    outcome, seconds = load_in_a_subprocess(repo_id, hub, tmp_path, UNREACHABLE_HUB)
    assert outcome == "loaded"
    assert seconds < FEW_SECONDS
    converted = load_converted(tmp_path / "out.safetensors")
    expected = load_adapter_weights(hub.local["main"])
    assert converted.modules.keys() == expected.modules.keys()
    for name, factors in expected.modules.items():
        assert torch.equal(converted.modules[name].lora_a, factors.lora_a)
        assert torch.equal(converted.modules[name].lora_b, factors.lora_b)
