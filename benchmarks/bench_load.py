"""Adapter load time: a PEFT checkpoint folder vs the converted file, for a Llama-3-8B-shaped rank-16 adapter.

The adapter is random tensors in PEFT's layout written straight with safetensors (no model needed): 32 layers,
hidden 4096, GQA 32/8 heads of 128 (k/v out 1024), MLP 14336, LoRA on q,k,v,o,gate,up,down, float32 as PEFT
saves by default. Each way of loading is timed on the CPU with a warm page cache (one untimed round first), as
the median of several loads taken in turns, twice:

- ``read``: the call alone (``load_adapter_weights`` of the folder, ``load_converted`` of the file);
- ``read+copy``: the call plus copying every factor into a preallocated float32 buffer, as the adapter store does
  when it writes a slot. Tensors mapped from the file but not yet touched cost their page faults here, so this
  is the number that compares what serving pays.

``safetensors_floor`` reads the converted fp32 file with plain ``safe_open(...).get_tensors()`` and no checks:
the I/O floor that any loader of this file pays.

Run: ``python benchmarks/bench_load.py [--repeats N]``; writes ``benchmarks/results/bench_load.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from punica_hf.formats import DTYPES, convert_adapter, load_converted
from punica_hf.formats import AdapterWeights, load_adapter_weights

LAYERS, HIDDEN, KV_OUT, MLP, RANK, ALPHA = 32, 4096, 8 * 128, 14336, 16, 32
# module -> (in, out)
PROJECTIONS = {
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (HIDDEN, KV_OUT),
    "self_attn.v_proj": (HIDDEN, KV_OUT),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (HIDDEN, MLP),
    "mlp.up_proj": (HIDDEN, MLP),
    "mlp.down_proj": (MLP, HIDDEN),
}
RESULTS = Path(__file__).resolve().parent / "results" / "bench_load.json"


def write_peft_adapter(folder: Path) -> Path:
    """A PEFT-format adapter folder (config + float32 safetensors) with random factors."""
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(LAYERS):
        for projection, (in_features, out_features) in PROJECTIONS.items():
            prefix = f"base_model.model.model.layers.{layer}.{projection}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, in_features, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, RANK, generator=generator)
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": ALPHA,
        "target_modules": [name.split(".")[1] for name in PROJECTIONS],
        "base_model_name_or_path": "meta-llama/Meta-Llama-3-8B",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def factor_tensors(weights: AdapterWeights) -> dict[str, torch.Tensor]:
    """The factors of a loaded adapter by tensor name, so every variant is timed through the same copy."""
    tensors = {}
    for name, factors in weights.modules.items():
        tensors[f"{name}.lora_a"], tensors[f"{name}.lora_b"] = factors.lora_a, factors.lora_b
    return tensors


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt", device="cpu") as file:
        return file.get_tensors()


def copy_tensors(tensors: dict[str, torch.Tensor]) -> None:
    """What the adapter store does with a loaded adapter: copy every factor into float32 slot buffers."""
    for tensor in tensors.values():
        torch.empty(tensor.shape).copy_(tensor)


def median_milliseconds(
    loads: dict[str, Callable[[], dict[str, torch.Tensor]]], repeats: int, then_copy: bool
) -> dict[str, float]:
    """Median time of each load; the variants take turns in every round, so machine noise hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in loads}
    for round_number in range(repeats + 1):
        for name, load in loads.items():
            start = time.perf_counter()
            tensors = load()
            if then_copy:
                copy_tensors(tensors)
            if round_number:  # round 0 warms the page cache and any lazy imports
                times[name].append(time.perf_counter() - start)
            del tensors
    return {name: round(1000 * statistics.median(values), 1) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed loads per variant (default 9)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the machine is shared; one thread keeps the comparison steady

    with tempfile.TemporaryDirectory() as tmp:
        peft_folder = write_peft_adapter(Path(tmp) / "peft")
        variants = {"peft_folder": (peft_folder, lambda: factor_tensors(load_adapter_weights(peft_folder)))}
        for dtype_name in ("fp32", "bf16"):
            path = Path(tmp) / f"converted_{dtype_name}.safetensors"
            convert_adapter(peft_folder, path, dtype=DTYPES[dtype_name])
            variants[f"converted_{dtype_name}"] = (path, lambda path=path: factor_tensors(load_converted(path)))
        floor_path = variants["converted_fp32"][0]
        variants["safetensors_floor"] = (floor_path, lambda: read_tensors(floor_path))
        if not torch.equal(
            load_adapter_weights(peft_folder).modules["model.layers.0.self_attn.q_proj"].lora_b,
            load_converted(variants["converted_fp32"][0]).modules["model.layers.0.self_attn.q_proj"].lora_b,
        ):
            raise SystemExit("converted fp32 factors differ from the PEFT folder's")

        loads = {name: load for name, (_, load) in variants.items()}
        read = median_milliseconds(loads, args.repeats, then_copy=False)
        read_copy = median_milliseconds(loads, args.repeats, then_copy=True)
        results = {}
        for name, (path, _) in variants.items():
            size = sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size
            results[name] = {"size_mb": round(size / 2**20, 1), "read_ms": read[name], "read_copy_ms": read_copy[name]}
            print(f"{name:18} {results[name]}")

    peft, converted = results["peft_folder"], results["converted_fp32"]
    report = {
        "adapter": f"Llama-3-8B shape, {LAYERS} layers x {len(PROJECTIONS)} modules, rank {RANK}",
        "repeats": args.repeats,
        "torch_threads": 1,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "results": results,
        "speedup_fp32_read": round(peft["read_ms"] / converted["read_ms"], 2),
        "speedup_fp32_read_copy": round(peft["read_copy_ms"] / converted["read_copy_ms"], 2),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"speedup (fp32): read {report['speedup_fp32_read']}x, read+copy {report['speedup_fp32_read_copy']}x")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
