"""Step time of each adapter kind punica_hf serves beyond plain LoRA, against plain LoRA and the base model.

Issue 33 asks what each new path costs next to the plain-LoRA one. One forward of a Llama-3-8B-shaped model with
random weights (bf16) is timed per kind: a decode step (``--batches`` rows of one token each, over a static KV
cache of ``--context`` positions) and a prefill (``--prefill`` = rows x tokens, the output layer on each row's last
position, as ``generate()`` runs it). Kinds, each with ``--adapters`` distinct rank-``--rank`` adapters, row ``i``
using adapter ``i mod --adapters``:

- ``base``: the model unwrapped, as its users run it;
- ``lora``: plain LoRA on q, k, v, o, gate, up and down;
- ``dora``: the same with DoRA (a per-output-row scale of every projection);
- ``lora_bias``: the same with ``lora_bias=True`` (a per-output-row shift; ``bias="lora_only"`` / ``"all"`` are
  the same shift, and Llama has no base biases);
- ``vocab``: plain LoRA plus LoRA on ``embed_tokens`` and ``lm_head``;
- ``alora``: plain LoRA as aLoRA adapters whose invocation tokens are in every prompt (the prefill runs the
  positions before it as the base model; a decode step's token has the adapter).

And a Qwen3-MoE-shaped model (30B-A3B's layers, ``--moe-layers`` of them): ``base``; ``lora`` on q, k, v, o; and
``experts``: that plus LoRA on every expert's ``gate_up_proj`` and ``down_proj`` (PEFT ``target_parameters``).

Adapters are built in memory as ``AdapterWeights`` (random factors, the fields PEFT's checkpoints are read into;
writing 8B-shaped PEFT checkpoints would take longer than the timing) and registered with ``load_adapters``,
one kind at a time on a fresh ``MultiLoraModel`` that is unwrapped after it. Timed calls go to the wrapped model's
inner forward with device slots from a lease held across the timing, as ``generate()`` and the engine call it.

Eager steps: the median wall time of ``--reps`` calls, each between two synchronizations (as ``generate()`` reads
each step's tokens). CUDA graphs (``--graphs``, on a GPU): every decode step is also captured alone
(``cuda_graph.capture``) and its replays timed with CUDA events (median). The MoE model's steps are never captured:
LoRA on experts reads the routing on the host (the engine serves MoE adapters with ``cuda_graphs=False``). Each
forward also records how far its logits move from the base model's and from plain LoRA's (the last position of the
prefill): every kind must change them, or its adapters did not run.

    # the run of record (writes benchmarks/results/bench_adapter_kinds_h200.json; about 3 minutes on an H200 by
    # estimate: most of it building the adapters and the MoE model's eager steps, which read the routing on the host):
    python benchmarks/bench_adapter_kinds.py
    # CPU smoke test of every path (tiny models, seconds; writes a file in the temp folder):
    python benchmarks/bench_adapter_kinds.py --tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM, StaticCache

from bench_generate import (
    TARGETS, build_llama, environment, llama_config, median, pool_bytes_for, random_adapter, synchronize,
)
from punica_hf import MultiLoraModel
from punica_hf.formats import AdapterWeights, ModuleLora, expert_entry
from punica_hf.model import alora_start
from punica_hf.moe_layer import EXPERT_PARAMETERS, experts_problem

LLAMA_KINDS = ("base", "lora", "dora", "lora_bias", "vocab", "alora")
MOE_KINDS = ("base", "lora", "experts")
INVOCATION = (11, 12, 13)  # aLoRA invocation tokens, placed in every prompt
MOE_GRAPHS = "not captured: LoRA on MoE experts reads the routing on the host"
# Full-size and --tiny defaults of the size options.
SIZES = {"layers": (32, 2), "moe_layers": (4, 2), "adapters": (32, 4), "batches": ("32,128", "4,8"),
         "prefill": ("4x512", "2x24"), "context": (512, 32), "reps": (20, 2), "moe_reps": (5, 2)}


def qwen3_moe_config(layers: int, tiny: bool = False) -> Qwen3MoeConfig:
    """Qwen3-30B-A3B's layer shape (hidden 2048, 32/4 heads of 128, 128 experts of width 768, 8 per token, vocab
    151936), or a tiny one for the CPU."""
    if tiny:
        return Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              num_experts=8, num_experts_per_tok=2, max_position_embeddings=2048)
    return Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, max_position_embeddings=4096)


def build_moe(config: Qwen3MoeConfig, device: torch.device) -> Qwen3MoeForCausalLM:
    with device:
        return Qwen3MoeForCausalLM._from_config(config, dtype=torch.bfloat16).eval()


# ------------------------------------------------------------------------------------------- adapters
def module_name(model: torch.nn.Module, wanted: torch.nn.Module) -> str:
    return next(name for name, module in model.named_modules() if module is wanted)


def row_norms(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weight row norms (float32, CPU) of each projection ``random_adapter`` targets: DoRA's magnitude as PEFT
    starts it."""
    return {name: torch.linalg.norm(module.weight.float(), dim=1).cpu() for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS}


def kind_adapter(model: torch.nn.Module, kind: str, rank: int, generator: torch.Generator,
                 norms: dict[str, torch.Tensor] | None = None) -> AdapterWeights:
    """One random adapter of ``kind`` (``LLAMA_KINDS`` / ``MOE_KINDS`` but base) on ``model``'s attention and MLP
    projections (a MoE model's: attention only), with factors drawn on the generator's device, kept in bf16 on
    the CPU. ``norms``: ``row_norms`` of the model (DoRA only)."""
    plain = random_adapter(model, rank, generator)
    device = generator.device

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device=device) * scale).to("cpu", torch.bfloat16)

    modules = dict(plain.modules)
    config = plain.config
    if kind == "dora":  # magnitudes near the weight's row norms: output scales near 1
        modules = {name: dataclasses.replace(factors, magnitude=norms[name] * (1 + 0.05 * torch.rand(len(norms[name]))))
                   for name, factors in modules.items()}
    elif kind == "lora_bias":
        modules = {name: dataclasses.replace(factors, lora_bias=randn(factors.lora_b.shape[0], scale=0.01))
                   for name, factors in modules.items()}
    elif kind == "vocab":
        embeddings, output = model.get_input_embeddings(), model.get_output_embeddings()
        vocab, hidden = embeddings.weight.shape
        modules[module_name(model, embeddings)] = ModuleLora(randn(rank, vocab, scale=1.0),
                                                             randn(hidden, rank, scale=0.01))
        modules[module_name(model, output)] = ModuleLora(randn(rank, hidden, scale=hidden**-0.5),
                                                         randn(vocab, rank, scale=0.01))
    elif kind == "alora":
        config = dataclasses.replace(config, alora_invocation_tokens=INVOCATION)
    elif kind == "experts":
        modules.update(expert_lora(model, rank, randn))
    elif kind != "lora":
        raise ValueError(f"unknown adapter kind {kind!r}")
    return dataclasses.replace(plain, modules=modules, config=config, source=f"random {kind}")


def expert_lora(model: torch.nn.Module, rank: int, randn: Callable[..., torch.Tensor]) -> dict[str, ModuleLora]:
    """LoRA on every expert of every fused experts module of ``model``, by ``expert_entry`` name (the names a PEFT
    ``target_parameters`` checkpoint is split into), each expert's factors one slice of a stacked draw."""
    modules = {}
    for name, experts in model.named_modules():
        if experts_problem(experts) is not None:
            continue
        for parameter in EXPERT_PARAMETERS:
            count, out_features, in_features = getattr(experts, parameter).shape  # [E, out, in]
            lora_a = randn(count, rank, in_features, scale=in_features**-0.5)
            lora_b = randn(count, out_features, rank, scale=0.01)
            for expert in range(count):
                modules[expert_entry(f"{name}.{parameter}", expert)] = ModuleLora(lora_a[expert], lora_b[expert])
    if not modules:
        raise ValueError(f"{type(model).__name__} has no experts module punica_hf serves LoRA on")
    return modules


# ------------------------------------------------------------------------------------------- steps
@dataclasses.dataclass
class Step:
    """One timed forward: ``input_ids`` ``[B, T]`` written into ``cache`` from position ``start`` on."""

    case: str
    input_ids: torch.Tensor
    cache: StaticCache
    start: int
    logits_to_keep: int

    def run(self, model: torch.nn.Module, **adapter_kwargs) -> torch.Tensor:
        # The static cache advances its write position on every call: set back first, so every call (and every
        # replay of a captured one) writes the same positions.
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(self.start)
        rows, length = self.input_ids.shape
        positions = torch.arange(self.start, self.start + length, device=self.input_ids.device).expand(rows, length)
        return model(input_ids=self.input_ids, position_ids=positions, past_key_values=self.cache, use_cache=True,
                     logits_to_keep=self.logits_to_keep, **adapter_kwargs).logits


def make_steps(config, args, device: torch.device, generator: torch.Generator) -> list[Step]:
    """The decode steps (one per batch size, the last position of a ``--context`` cache) and the prefill (the
    whole cache of each row). Every prompt holds the aLoRA invocation three quarters of the way in."""
    steps = []
    for batch in args.batches:
        tokens = torch.randint(100, config.vocab_size, (batch, 1), generator=generator, device=device)
        steps.append(Step(f"decode {batch}", tokens, StaticCache(config=config, max_cache_len=args.context),
                          args.context - 1, 0))
    rows, length = args.prefill
    prompt = torch.randint(100, config.vocab_size, (rows, length), generator=generator, device=device)
    at = 3 * length // 4
    prompt[:, at : at + len(INVOCATION)] = torch.tensor(INVOCATION, device=device)
    steps.append(Step(f"prefill {rows}x{length}", prompt, StaticCache(config=config, max_cache_len=length), 0, 1))
    return steps


def eager_ms(call: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median wall time of ``call`` between two synchronizations, after two untimed calls."""
    for _ in range(2):
        call()
    times = []
    for _ in range(reps):
        synchronize(device)
        started = time.perf_counter()
        call()
        synchronize(device)
        times.append(1e3 * (time.perf_counter() - started))
    return median(times)


def graph_ms(call: Callable[[], object], reps: int) -> float:
    """Median CUDA-event time of one replay of ``call`` captured in a CUDA graph."""
    from cuda_graph import capture

    graph = capture(call)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return median(times)


def time_kind(model_name: str, kind: str, model: torch.nn.Module, steps: list[Step], adapter_kwargs: Callable,
              reps: int, graphs: bool, device: torch.device) -> list[dict]:
    """Rows of one kind: each step eager, and each decode step replayed from a CUDA graph where ``graphs``.
    ``adapter_kwargs(step)``: the forward's adapter arguments for the step's rows."""
    rows = []
    for step in steps:
        kwargs = adapter_kwargs(step)

        def call(step=step, kwargs=kwargs) -> torch.Tensor:
            return step.run(model, **kwargs)

        row = {"model": model_name, "kind": kind, "case": step.case, "mode": "eager",
               "ms": eager_ms(call, reps, device)}
        rows.append(row)
        print(f"{model_name:6s} {kind:10s} {step.case:16s} eager {row['ms']:9.2f} ms", flush=True)
        if graphs and step.case.startswith("decode"):
            graph_row = {**row, "mode": "cuda graph"}
            try:
                graph_row["ms"] = graph_ms(call, reps)
                print(f"{model_name:6s} {kind:10s} {step.case:16s} graph {graph_row['ms']:9.2f} ms", flush=True)
            except Exception as error:  # recorded, and the run goes on with the other kinds
                graph_row.update(ms=None, error=f"{type(error).__name__}: {error}"[:500])
                print(f"{model_name:6s} {kind:10s} {step.case:16s} graph failed: {graph_row['error']}", flush=True)
            rows.append(graph_row)
    return rows


def last_logits(model: torch.nn.Module, steps: list[Step], adapter_kwargs: Callable) -> torch.Tensor:
    """The prefill's logits (each row's last position), float32 on the CPU."""
    step = steps[-1]
    return step.run(model, **adapter_kwargs(step)).float().cpu()


def adapter_arguments(kind: str, slots: torch.Tensor) -> Callable[[Step], dict]:
    """The forward's adapter arguments for a step's rows: row ``i`` gets ``slots[i mod len(slots)]``; aLoRA rows
    also their offsets, as ``MultiLoraModel`` finds them once per call."""

    def arguments(step: Step) -> dict:
        rows, length = step.input_ids.shape
        row_slots = slots[torch.arange(rows, device=slots.device) % len(slots)]
        if kind != "alora":
            return {"adapter_ids": row_slots}
        if length == 1:  # a decode step after a prompt that holds the invocation: its token has the adapter
            offsets = [1] * rows
        else:  # PEFT's offsets: each row's length from the start of its invocation on
            offsets = [length - alora_start(INVOCATION, row) for row in step.input_ids.tolist()]
        return {"adapter_ids": row_slots, "alora_offsets": torch.tensor(offsets, device=slots.device)}

    return arguments


@torch.no_grad()
def run_model(model_name: str, model: torch.nn.Module, kinds: tuple[str, ...], args, device: torch.device,
              graphs: bool, reps: int, report: Report) -> None:
    """Every kind of ``kinds`` on ``model``, into ``report``: timing rows, and each kind's largest logit change
    from the base model's and from plain LoRA's on the prefill. Every kind's adapters hold the same plain factors
    (drawn from the same seed), so a change from plain LoRA's logits is the kind's own feature at work. A kind that
    fails is recorded and the run goes on (a GPU session has one try)."""
    steps = make_steps(model.config, args, device, torch.Generator(device).manual_seed(0))
    logits = {}
    norms = row_norms(model) if "dora" in kinds else None
    for kind in kinds:
        served = None
        try:
            if kind == "base":  # the model unwrapped, as its users run it
                report.add(time_kind(model_name, kind, model, steps, lambda step: {}, reps, graphs, device))
                logits[kind] = last_logits(model, steps, lambda step: {})
                continue
            generator = torch.Generator(device).manual_seed(1)
            adapters = {f"{kind}{i}": kind_adapter(model, kind, args.rank, generator, norms)
                        for i in range(args.adapters)}
            served = MultiLoraModel(model, max_adapters=args.adapters, max_rank=args.rank,
                                    gpu_pool_bytes=pool_bytes_for(list(adapters.values())))
            served.load_adapters(adapters)
            del adapters
            with served.acquire(list(served.adapters)) as lease:
                arguments = adapter_arguments(kind, torch.tensor(lease.slots, dtype=torch.int32, device=device))
                report.add(time_kind(model_name, kind, served.model, steps, arguments, reps, graphs, device))
                logits[kind] = last_logits(served.model, steps, arguments)
            report.changes.setdefault(model_name, {})[kind] = {
                reference: (logits[kind] - logits[reference]).abs().max().item()
                for reference in ("base", "lora") if reference in logits and reference != kind
            }
        except Exception as error:
            report.errors.append({"model": model_name, "kind": kind, "error": f"{type(error).__name__}: {error}"})
            print(f"{model_name} {kind} FAILED: {report.errors[-1]['error']}", flush=True)
        finally:
            if served is not None:
                served.unwrap()
            del served
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()


class Report:
    """Rows, logit changes and failures so far, written to ``path`` after every kind: a run cut short keeps what
    it measured."""

    def __init__(self, path: Path, data: dict) -> None:
        self.path = path
        self.data = data
        self.rows: list[dict] = []
        self.changes: dict[str, dict] = {}
        self.errors: list[dict] = []

    def add(self, rows: list[dict]) -> None:
        self.rows += rows
        add_ratios(self.rows)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {**self.data, "rows": self.rows, "max_abs_logit_change": self.changes, "errors": self.errors}
        self.path.write_text(json.dumps(data, indent=2) + "\n")


def add_ratios(rows: list[dict]) -> None:
    """Each timed row's ratio to plain LoRA's and to the base model's row of the same model, case and mode."""
    timed = {(r["model"], r["kind"], r["case"], r["mode"]): r["ms"] for r in rows}
    for row in rows:
        for reference in ("lora", "base"):
            other = timed.get((row["model"], reference, row["case"], row["mode"]))
            row[f"to_{reference}"] = row["ms"] / other if row["ms"] is not None and other else None


def table(rows: list[dict]) -> str:
    lines = ["| model | kind | case | mode | ms | / plain LoRA | / base |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = ["-" if r[k] is None else f"{r[k]:.2f}" for k in ("ms", "to_lora", "to_base")]
        lines.append(f"| {r['model']} | {r['kind']} | {r['case']} | {r['mode']} | {' | '.join(cells)} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- the run
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny models (CPU if no GPU): a smoke test of every path")
    parser.add_argument("--layers", type=int, help="Llama decoder layers (default 32 = Llama-3-8B; tiny 2)")
    parser.add_argument("--moe-layers", type=int, help="Qwen3-MoE decoder layers (default 4; tiny 2; 0 = no MoE)")
    parser.add_argument("--adapters", type=int, help="distinct adapters per kind (default 32; tiny 4)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank of every adapter")
    parser.add_argument("--batches", help="decode batch sizes (default 32,128; tiny 4,8)")
    parser.add_argument("--prefill", help="prefill rows x tokens (default 4x512; tiny 2x24)")
    parser.add_argument("--context", type=int, help="KV positions of a decode step's cache (default 512; tiny 32)")
    parser.add_argument("--reps", type=int, help="timed calls per measurement (default 20; tiny 2)")
    parser.add_argument("--moe-reps", type=int, help="timed calls per MoE measurement (default 5; tiny 2)")
    parser.add_argument("--kinds", default=",".join(LLAMA_KINDS[1:]), help="Llama kinds besides base")
    parser.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="also time decode steps replayed from CUDA graphs (GPU only)")
    parser.add_argument("--output", type=Path, help="default: benchmarks/results/bench_adapter_kinds_h200.json; "
                        "with --tiny, bench_adapter_kinds_tiny.json in the temp folder")
    args = parser.parse_args()
    for option, (full, tiny) in SIZES.items():
        if getattr(args, option) is None:
            setattr(args, option, tiny if args.tiny else full)
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.prefill = tuple(int(n) for n in str(args.prefill).lower().split("x"))
    kinds = args.kinds.split(",") if args.kinds else []
    unknown = set(kinds) - set(LLAMA_KINDS[1:])
    if unknown:
        parser.error(f"--kinds: unknown {sorted(unknown)}; choose from {list(LLAMA_KINDS[1:])}")
    args.kinds = ("base", *(k for k in LLAMA_KINDS[1:] if k in kinds))
    if len(args.prefill) != 2 or min(args.prefill) < 1 or args.prefill[1] < len(INVOCATION) + 4:
        parser.error(f"--prefill must be ROWSxTOKENS with at least {len(INVOCATION) + 4} tokens")
    if min(args.batches) < 1 or args.adapters < 1 or args.context < 2:
        parser.error("--batches, --adapters must be positive and --context at least 2")
    if args.output is None:
        args.output = (Path(tempfile.gettempdir()) / "bench_adapter_kinds_tiny.json" if args.tiny
                       else Path(__file__).resolve().parent / "results" / "bench_adapter_kinds_h200.json")
    return args


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available() and not args.tiny:
        raise SystemExit("bench_adapter_kinds.py needs a CUDA GPU (or --tiny for a CPU smoke test)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    graphs = args.graphs and device.type == "cuda"
    torch.manual_seed(0)
    started = time.perf_counter()
    setup = {**vars(args), "output": str(args.output),
             "llama": f"Llama-3-8B shape, {args.layers} layers, bf16" if not args.tiny else "tiny Llama",
             "moe": f"Qwen3-30B-A3B shape, {args.moe_layers} layers, bf16" if not args.tiny else "tiny Qwen3-MoE"}
    notes = {"llama graphs": "decode steps captured" if graphs else "not captured: no GPU or --no-graphs",
             "moe graphs": MOE_GRAPHS}
    report = Report(args.output, {"environment": environment(device), "setup": setup, "notes": notes})
    model = build_llama(llama_config(args.layers, args.tiny), device)
    run_model("llama", model, args.kinds, args, device, graphs, args.reps, report)
    del model
    gc.collect()
    if args.moe_layers:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        moe = build_moe(qwen3_moe_config(args.moe_layers, args.tiny), device)
        run_model("moe", moe, MOE_KINDS, args, device, False, args.moe_reps, report)
        del moe
    report.data["seconds"] = time.perf_counter() - started
    report.write()
    print(table(report.rows))
    print("\n".join(f"{key}: {note}" for key, note in notes.items()))
    print(f"written to {args.output} ({report.data['seconds']:.0f} s)")
    if report.errors:
        raise SystemExit(f"{len(report.errors)} kinds failed: {[(e['model'], e['kind']) for e in report.errors]}")


if __name__ == "__main__":
    main()
