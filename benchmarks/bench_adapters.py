"""The adapter store on one GPU (issue 8): time to servable, decoding over 1,000 adapters, GPU bytes, loads mid-decode.

Llama-3-8B shape with random weights, bf16; rank-16 adapters on q,k,v,o,gate,up,down of every layer (random factors,
small B). Sources on local disk are converted bf16 files (``save_converted``) and one PEFT folder (fp32, as PEFT
saves LoRA weights by default), written here; the page cache is warm for every read (the files were just written).

1. GPU bytes per resident adapter at ranks 8, 16, 64 (``adapter_stats`` deltas) against the adapter's own factors
   and against the fixed slots of the former design (``max_rank`` = 64 rows per module per slot).
2. Time to servable, median of ``--repeats``: host memory (registered, host copy present, not resident:
   ``acquire([name])`` + synchronize), converted file on disk and PEFT folder on disk (``load_adapters`` + ``acquire``
   + synchronize). The pool is full, so each acquire also evicts one adapter, as in steady serving.
3. Decode steps while another thread registers and prefetches adapters: every step's duration from a streamer,
   max against median.
4. Decoding: 1,000 registered adapters, each its own file (hard links to ``--factor-sets`` distinct random files:
   84 MB x 1,000 would not fit the disk) and a host tier of ``--host-adapters`` adapters, so cold adapters are read
   again from disk; a device pool of exactly 64 rank-16 adapters (``max_adapters=64``). Each batch of 32 rows draws
   its adapters from Zipf(1.5) popularity and runs ``generate()`` (eager, ``--new-tokens``) by name: loads happen on
   demand inside the timed call. Right after, the same batch runs again with all its adapters resident: the
   all-resident baseline, interleaved batch by batch so machine drift hits both alike. Before timing, 40 batches
   are drawn and loaded (no decoding) so that the pool and the host tier hold what this popularity keeps there.

Results go to the JSON after each section, so a run cut short by a timeout keeps what it measured.

    python benchmarks/bench_adapters.py            # H200, about 2 minutes
    python benchmarks/bench_adapters.py --tiny     # CPU smoke test: tiny shapes
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench_generate import (StepClock, build_llama, environment, factor_bytes, llama_config, median, pool_bytes_for,
                            random_adapter, synchronize)
from punica_hf import MultiLoraModel
from punica_hf.formats import AdapterWeights, save_converted

TARGET_HOST_MS = 10.0
TARGET_DISK_MS = 50.0
TARGET_ZIPF_RATIO = 0.90
TARGET_BYTES_OVER_FACTORS = 1.25
TARGET_STEP_OVER_MEDIAN = 2.0  # "delays no decode step by more than one step's duration"
FIXED_SLOT_RANK = 64  # the former design reserved max_rank=64 rows per module in every slot
# Full-size and --tiny defaults of the size options.
SIZES = {"layers": (32, 2), "registered": (1000, 200), "pool_adapters": (64, 8), "batch": (32, 8),
         "factor_sets": (16, 4), "host_adapters": (200, 50), "batches": (10, 4), "warm_up_batches": (40, 10),
         "live_loads": (8, 3), "live_steps": (64, 24)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny model (CPU if no GPU): a smoke test")
    parser.add_argument("--layers", type=int, help="decoder layers (default 32; tiny 2)")
    parser.add_argument("--rank", type=int, default=16, help="rank of the served adapters")
    parser.add_argument("--registered", type=int, help="registered adapters (default 1000; tiny 200)")
    parser.add_argument("--pool-adapters", type=int, help="device pool, in adapters of --rank (default 64; tiny 8)")
    parser.add_argument("--host-adapters", type=int, help="host tier budget, in adapters (default 200; tiny 50)")
    parser.add_argument("--factor-sets", type=int, help="distinct random factor files behind the adapters (16; 4)")
    parser.add_argument("--batch", type=int, help="rows per batch (default 32; tiny 8)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, default=32, help="new tokens per row and batch")
    parser.add_argument("--batches", type=int, help="timed batches (default 10; tiny 4)")
    parser.add_argument("--warm-up-batches", type=int,
                        help="batches drawn and loaded without decoding first, to reach steady state (40; tiny 10)")
    parser.add_argument("--zipf", type=float, default=1.5, help="popularity exponent")
    parser.add_argument("--prefetch-next", action="store_true",
                        help="as a server does: hold a batch's adapters, prefetch the next batch's, then decode")
    parser.add_argument("--repeats", type=int, default=9, help="loads timed per time-to-servable case")
    parser.add_argument("--live-loads", type=int, help="adapters loaded during one generate() (default 8; tiny 3)")
    parser.add_argument("--live-steps", type=int, help="decode steps of that generate() (default 64; tiny 24)")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/bench_adapters_h200.json"))
    args = parser.parse_args()
    for option, (full, tiny) in SIZES.items():
        if getattr(args, option) is None:
            setattr(args, option, tiny if args.tiny else full)
    if args.warm_up_batches < 1:
        parser.error("--warm-up-batches must be at least 1 (its last batch also warms up the decode)")
    if args.batch > args.pool_adapters:
        parser.error("--batch must not exceed --pool-adapters (a batch's adapters must fit on the device at once)")
    return args


class Report:
    """Results so far, written after every section: a run cut short by a timeout keeps what it measured."""

    def __init__(self, path: Path, data: dict) -> None:
        self.path = path
        self.data = data
        self.started = time.perf_counter()
        self.write()

    def add(self, section: str, result: dict) -> None:
        self.data[section] = result
        self.data.setdefault("section_seconds", {})[section] = round(time.perf_counter() - self.started, 1)
        self.data["summary"] = summary(self.data)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2) + "\n")


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available() and not args.tiny:
        raise SystemExit("bench_adapters.py needs a CUDA GPU (or --tiny for a CPU smoke test)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    config = llama_config(args.layers, args.tiny)
    model = build_llama(config, device)
    report = Report(args.output, {"environment": environment(device),
                                  "setup": {**vars(args), "output": str(args.output), "dtype": "bfloat16"}})
    generator = torch.Generator(device).manual_seed(1)
    factor_sets = [random_adapter(model, args.rank, generator) for _ in range(args.factor_sets)]

    report.add("memory_per_rank", memory_per_rank(model, factor_sets[0], generator, device))
    # What the store really takes for one served adapter: the pool and the host tier are sized in these.
    adapter_gpu_bytes = next(r["gpu_bytes"] for r in report.data["memory_per_rank"]["rows"] if r["rank"] == args.rank)

    with tempfile.TemporaryDirectory(prefix="bench_adapters_") as tmp:
        sources = write_sources(Path(tmp), factor_sets, args.registered)
        served = MultiLoraModel(model, max_adapters=args.pool_adapters, max_rank=args.rank,
                                gpu_pool_bytes=args.pool_adapters * adapter_gpu_bytes,
                                host_pool_bytes=args.host_adapters * adapter_gpu_bytes)
        input_ids = torch.randint(1, config.vocab_size, (args.batch, args.prompt), device=device)
        # The cheap sections first (a run cut short keeps them): they need a full pool and a few adapters with host
        # copies only. Then the other registrations, and the decoding over all of them.
        names = list(sources["adapters"])
        first = names[: args.pool_adapters + 2 * args.repeats]
        registered_first = register(served, {name: sources["adapters"][name] for name in first}, device)
        report.add("time_to_servable", time_to_servable(served, sources, args.repeats, device))
        report.add("loads_during_decode", loads_during_decode(served, first[: args.batch], sources, input_ids, args))
        registered_rest = register(served, {name: sources["adapters"][name] for name in names[len(first):]}, device)
        seconds = registered_first["seconds"] + registered_rest["seconds"]
        report.add("registration", {**registered_rest, "adapters": len(names), "seconds": seconds,
                                    "ms_per_adapter": 1000 * seconds / len(names)})
        report.add("zipf_decode", zipf_decode(served, names, input_ids, args, device))
    print_table(report.data)


# ------------------------------------------------------------------------------------------- sources
def write_sources(folder: Path, factor_sets: list[AdapterWeights], registered: int) -> dict:
    """Converted bf16 files of the factor sets, one PEFT folder (set 0, fp32), and ``registered`` adapter files.

    Every registered adapter has a path of its own: a hard link to one of the set files.
    """
    set_files = [save_converted(weights, folder / f"set{k}.safetensors", dtype=torch.bfloat16)
                 for k, weights in enumerate(factor_sets)]
    adapters = {}
    for i in range(registered):
        path = folder / f"adapter{i:04d}.safetensors"
        os.link(set_files[i % len(set_files)], path)
        adapters[f"adapter{i:04d}"] = path
    return {"set_files": set_files, "peft_folder": write_peft_folder(folder / "peft", factor_sets[0]),
            "adapters": adapters, "filesystem": filesystem_type(folder)}


def filesystem_type(path: Path) -> str:
    """The type of the file system holding ``path`` (tmpfs would mean "disk" reads come from memory)."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "unknown"
    resolved = str(path.resolve())
    holding = [(mount, kind) for _, mount, kind, *_ in mounts
               if resolved == mount or resolved.startswith(mount.rstrip("/") + "/")]
    return max(holding, key=lambda found: len(found[0]))[1] if holding else "unknown"  # the innermost mount


def write_peft_folder(folder: Path, weights: AdapterWeights) -> Path:
    """A PEFT checkpoint folder: ``adapter_config.json`` + ``adapter_model.safetensors`` with PEFT's key names."""
    folder.mkdir()
    tensors = {}
    for module, factors in weights.modules.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = factors.lora_a.float().contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = factors.lora_b.float().contiguous()
    save_file(tensors, folder / "adapter_model.safetensors")
    rank = weights.config.r
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank,  # scaling 1: the factors are used as they are
              "target_modules": sorted({module.rsplit(".", 1)[-1] for module in weights.modules})}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def register(served: MultiLoraModel, adapters: dict[str, Path], device: torch.device) -> dict:
    """Register every adapter file, from a few threads (reads overlap; the store serialises its own work)."""
    names = list(adapters)
    threads = min(4, os.cpu_count() or 1)

    def register_share(share: list[str]) -> None:
        for name in share:
            served.load_adapters({name: adapters[name]})

    started = time.perf_counter()
    workers = [threading.Thread(target=register_share, args=(names[i::threads],)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    synchronize(device)
    seconds = time.perf_counter() - started
    registered = served.adapters
    missing = [name for name in names if name not in registered]
    if missing:
        raise SystemExit(f"registration failed for {len(missing)} of {len(names)} adapters, e.g. {missing[0]}")
    result = {"adapters": len(names), "threads": threads, "seconds": seconds, "stats": served.adapter_stats}
    if device.type == "cuda" and hasattr(torch.cuda, "host_memory_stats"):
        # The pinned allocator rounds blocks up to powers of two: what the host tier really holds.
        result["pinned_allocated_bytes"] = torch.cuda.host_memory_stats().get("allocated_bytes.current")
    return result


# ------------------------------------------------------------------------------------------- the measurements
def memory_per_rank(model: torch.nn.Module, served_adapter: AdapterWeights, generator: torch.Generator,
                    device: torch.device) -> dict:
    """GPU bytes one resident adapter takes at ranks 8, 16, 64 and the served rank (pool bytes in use before and
    after it is placed)."""
    served_rank = served_adapter.config.r
    adapters = {rank: served_adapter if rank == served_rank else random_adapter(model, rank, generator)
                for rank in sorted({8, 16, FIXED_SLOT_RANK, served_rank})}
    served = MultiLoraModel(model, max_adapters=len(adapters), max_rank=FIXED_SLOT_RANK,
                            gpu_pool_bytes=pool_bytes_for(list(adapters.values())))
    rows = []
    for rank, weights in adapters.items():
        before = served.adapter_stats["gpu_bytes_used"]
        served.load_adapters({f"rank{rank}": weights})
        served.acquire([f"rank{rank}"]).release()  # resident for sure (registration places it only if it fits)
        gpu_bytes = served.adapter_stats["gpu_bytes_used"] - before
        own = factor_bytes(weights)
        fixed = own // rank * FIXED_SLOT_RANK  # r_max * (in + out) per module, bf16
        rows.append({"rank": rank, "gpu_bytes": gpu_bytes, "factor_bytes": own, "fixed_slot_bytes": fixed,
                     "gpu_over_factors": gpu_bytes / own, "fixed_slot_over_factors": fixed / own})
    served.unwrap()
    del served
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"rows": rows, "device": str(device)}


def time_to_servable(served: MultiLoraModel, sources: dict, repeats: int, device: torch.device) -> dict:
    """Milliseconds from the call to an adapter usable on the device, three ways (see the module docstring)."""
    store = served._store
    in_host_only = [a.name for a in store._by_name.values() if a.slot is None and a.index in store.host]
    if len(in_host_only) < repeats:
        raise SystemExit(f"only {len(in_host_only)} adapters have a host copy and are not resident; need {repeats}")
    host = []
    for name in in_host_only[:repeats]:
        before = served.adapter_stats
        synchronize(device)
        started = time.perf_counter()
        lease = served.acquire([name])
        synchronize(device)
        host.append(1000 * (time.perf_counter() - started))
        lease.release()
        after = served.adapter_stats
        if after["disk_loads"] != before["disk_loads"] or after["host_loads"] != before["host_loads"] + 1:
            raise SystemExit(f"acquire({name!r}) did not load from the host tier: {before} -> {after}")

    def from_disk(source: Path, label: str) -> dict:
        """New registrations of ``source``, each finding the pool full as above (unloaded only at the end)."""
        register_ms, acquire_ms, total_ms = [], [], []
        names = [f"{label}{i}" for i in range(repeats)]
        for name in names:
            synchronize(device)
            started = time.perf_counter()
            served.load_adapters({name: source})
            registered = time.perf_counter()
            lease = served.acquire([name])
            synchronize(device)
            done = time.perf_counter()
            lease.release()
            register_ms.append(1000 * (registered - started))
            acquire_ms.append(1000 * (done - registered))
            total_ms.append(1000 * (done - started))
        added.extend(names)
        return {"median_ms": median(total_ms), "all_ms": total_ms, "load_adapters_median_ms": median(register_ms),
                "acquire_median_ms": median(acquire_ms)}

    added: list[str] = []
    converted = sources["set_files"][0]
    result = {
        "host": {"median_ms": median(host), "all_ms": host},
        "disk_converted_bf16": {**from_disk(converted, "converted"), "bytes": converted.stat().st_size},
        "disk_peft_fp32": {**from_disk(sources["peft_folder"], "peft"),
                           "bytes": sum(f.stat().st_size for f in sources["peft_folder"].iterdir())},
        "page_cache": "warm (files written by this run; every case reads the same file again)",
        "filesystem": sources["filesystem"],
        "pool": "full: each acquire evicts the least recently used adapter",
    }
    for name in added:
        served.unload_adapter(name)
    return result


def zipf_decode(served: MultiLoraModel, names: list[str], input_ids: torch.Tensor, args, device: torch.device) -> dict:
    """Batches whose rows draw adapters by Zipf popularity: on demand (loads inside the timed generate) vs the same
    batch again at once, every adapter resident."""
    draw = torch.Generator().manual_seed(2)
    popularity = torch.arange(1, len(names) + 1, dtype=torch.float64) ** -args.zipf
    by_popularity = [names[i] for i in torch.randperm(len(names), generator=draw).tolist()]  # not registration order
    batches = [[by_popularity[i] for i in torch.multinomial(popularity, args.batch, replacement=True,
                                                           generator=draw).tolist()]
               for _ in range(args.warm_up_batches + args.batches)]
    kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=args.new_tokens,
                  min_new_tokens=args.new_tokens, do_sample=False)

    def timed_generate(rows: list[str], prefetch: list[str] | None = None) -> float:
        synchronize(device)
        started = time.perf_counter()
        with served.acquire(rows):  # the batch's adapters are held, so the prefetch cannot evict them
            if prefetch:
                served.prefetch(sorted(set(prefetch)))
            served.generate(adapter_ids=rows, **kwargs)
        synchronize(device)
        return time.perf_counter() - started

    # Steady state first: the pool and the host tier hold what this popularity keeps there (from the registration
    # order they hold arbitrary adapters). Loading is enough for that; one decode warms up the kernels.
    for rows in batches[: args.warm_up_batches]:
        served.acquire(rows).release()
    timed_generate(batches[args.warm_up_batches - 1])
    before = served.adapter_stats
    per_batch = []
    timed = batches[args.warm_up_batches:]
    for number, rows in enumerate(timed):
        stats = served.adapter_stats
        following = timed[number + 1] if args.prefetch_next and number + 1 < len(timed) else None
        on_demand = timed_generate(rows, following)
        after = served.adapter_stats
        resident = timed_generate(rows)  # the batch's adapters were all placed by the call above
        per_batch.append({"distinct": len(set(rows)), "on_demand_s": on_demand, "resident_s": resident,
                          **{key: after[key] - stats[key] for key in ("host_loads", "disk_loads", "evictions")}})
    after = served.adapter_stats
    tokens = args.batch * args.new_tokens * args.batches
    on_demand_rate = tokens / sum(b["on_demand_s"] for b in per_batch)
    resident_rate = tokens / sum(b["resident_s"] for b in per_batch)
    return {
        "on_demand_tokens_per_second": on_demand_rate,
        "resident_tokens_per_second": resident_rate,
        "ratio": on_demand_rate / resident_rate,
        "added_seconds_per_batch": sum(b["on_demand_s"] - b["resident_s"] for b in per_batch) / len(per_batch),
        # Over both passes of the timed batches; only the on-demand pass loads anything.
        "counters": {key: after[key] - before[key] for key in ("hits", "host_loads", "disk_loads", "evictions",
                                                                 "bytes_to_gpu")},
        "mean_distinct_per_batch": sum(b["distinct"] for b in per_batch) / len(per_batch),
        "per_batch": per_batch,
        "host_tier": "pinned host tier of --host-adapters adapters; the others re-read from their files (disk, page "
                     "cache warm)",
        "prefetch_next": args.prefetch_next,
    }


def loads_during_decode(served: MultiLoraModel, rows: list[str], sources: dict, input_ids: torch.Tensor,
                        args) -> dict:
    """Every decode step's duration while another thread registers converted files and prefetches them, against
    the same generate() alone."""
    kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=args.live_steps,
                  min_new_tokens=args.live_steps, do_sample=False)
    served.generate(adapter_ids=rows, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # first-call costs
    alone = StepClock()
    served.generate(adapter_ids=rows, streamer=alone, **kwargs)

    first_step_done = threading.Event()
    loads: list[dict] = []

    def load_and_prefetch() -> None:
        first_step_done.wait()
        for i in range(args.live_loads):
            name = f"live{i}"
            started = time.perf_counter()
            served.load_adapters({name: sources["set_files"][i % len(sources["set_files"])]})
            served.prefetch([name])
            loads.append({"name": name, "start": started, "end": time.perf_counter()})

    loader = threading.Thread(target=load_and_prefetch)
    loader.start()
    # Pushes: the prompt, the prefill's token, then one per decode step; start loading once decoding runs.
    during = StepClock(on_put=lambda pushes: first_step_done.set() if pushes == 3 else None)
    served.generate(adapter_ids=rows, streamer=during, **kwargs)
    loader.join()
    for load in loads:
        served.unload_adapter(load["name"])

    steps = during.decode_step_seconds()
    step_ends = during.times[2:]
    overlapping = [i for i, (start, end) in enumerate(zip(during.times[1:], step_ends))
                   if any(load["start"] < end and load["end"] > start for load in loads)]
    return {
        "loads": len(loads),
        "loads_finished_before_last_step": sum(load["end"] <= step_ends[-1] for load in loads),
        "load_ms": [1000 * (load["end"] - load["start"]) for load in loads],
        "steps": len(steps),
        "median_step_ms": 1000 * median(steps),
        "max_step_ms": 1000 * max(steps),
        "max_over_median": max(steps) / median(steps),
        "steps_overlapping_loads": len(overlapping),
        "max_overlapping_step_ms": 1000 * max((steps[i] for i in overlapping), default=0.0),
        "alone_median_step_ms": 1000 * median(alone.decode_step_seconds()),
        "alone_max_step_ms": 1000 * max(alone.decode_step_seconds()),
        "step_ms": [round(1000 * s, 2) for s in steps],
    }


# ------------------------------------------------------------------------------------------- report
def summary(data: dict) -> list[dict]:
    """One row per target of the sections measured so far: what was measured, the target, met or not."""
    rows = []

    def add(what: str, value: float, unit: str, target: str, met: bool) -> None:
        rows.append({"what": what, "value": value, "unit": unit, "target": target, "met": met})

    for row in data.get("memory_per_rank", {}).get("rows", []):
        mib = {key: row[key] / 2**20 for key in ("gpu_bytes", "factor_bytes", "fixed_slot_bytes")}
        add(f"GPU bytes, rank {row['rank']}: {mib['gpu_bytes']:.1f} MiB (own factors {mib['factor_bytes']:.1f}, fixed "
            f"rank-{FIXED_SLOT_RANK} slot {mib['fixed_slot_bytes']:.1f} = {row['fixed_slot_over_factors']:.2f}x)",
            row["gpu_over_factors"], "x factors",
            f"<= {TARGET_BYTES_OVER_FACTORS}x", row["gpu_over_factors"] <= TARGET_BYTES_OVER_FACTORS)
    if "time_to_servable" in data:
        servable = data["time_to_servable"]
        add("host memory -> servable (host copy present)", servable["host"]["median_ms"], "ms",
            f"<= {TARGET_HOST_MS:g} ms", servable["host"]["median_ms"] <= TARGET_HOST_MS)
        for key, label in (("disk_converted_bf16", "converted bf16 file on disk -> servable"),
                           ("disk_peft_fp32", "PEFT folder (fp32) on disk -> servable")):
            case = servable[key]
            add(f"{label} (load_adapters {case['load_adapters_median_ms']:.1f} + acquire "
                f"{case['acquire_median_ms']:.1f} ms)", case["median_ms"], "ms", f"<= {TARGET_DISK_MS:g} ms",
                case["median_ms"] <= TARGET_DISK_MS)
    if "loads_during_decode" in data:
        live = data["loads_during_decode"]
        add(f"decode step during {live['loads']} loads + prefetches: max {live['max_step_ms']:.1f} ms vs median "
            f"{live['median_step_ms']:.1f} ms (alone: max {live['alone_max_step_ms']:.1f})", live["max_over_median"],
            "x median", f"<= {TARGET_STEP_OVER_MEDIAN:g}x", live["max_over_median"] <= TARGET_STEP_OVER_MEDIAN)
    if "zipf_decode" in data:
        zipf, setup = data["zipf_decode"], data["setup"]
        counters = zipf["counters"]
        add(f"{setup['registered']} adapters, Zipf({setup['zipf']}), pool of {setup['pool_adapters']}"
            f"{', next batch prefetched' if zipf.get('prefetch_next') else ''}: "
            f"{zipf['on_demand_tokens_per_second']:.0f} vs {zipf['resident_tokens_per_second']:.0f} tokens/s all "
            f"resident ({counters['host_loads']} loads, {counters['disk_loads']} from disk, {counters['evictions']} "
            f"evictions)", zipf["ratio"], "x", f">= {TARGET_ZIPF_RATIO:.2f}x", zipf["ratio"] >= TARGET_ZIPF_RATIO)
    return rows


def print_table(data: dict) -> None:
    env, registration = data["environment"], data["registration"]
    print(f"\n{env['gpu']}, torch {env['torch']}, transformers {env['transformers']}; registering "
          f"{registration['adapters']} adapters took {registration['seconds']:.1f} s; sections done at "
          f"{data['section_seconds']} s")
    print("\n| measurement | result | target | met |")
    print("|---|---|---|---|")
    for row in data["summary"]:
        value = f"{row['value']:.2f} {row['unit']}" if row["unit"] != "ms" else f"{row['value']:.1f} ms"
        print(f"| {row['what']} | {value} | {row['target']} | {'yes' if row['met'] else 'no'} |")


if __name__ == "__main__":
    main()
