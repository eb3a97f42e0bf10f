"""End-to-end generate() throughput: base model vs punica_hf (every row its own adapter) vs PEFT.

Llama-3-8B shape with random weights (no download), bf16, on one GPU. All systems run in one process, on
the same prompts, after a warm-up at exactly the timed shapes; tokens/s = batch * new tokens / wall time.
Only ratios inside one run mean anything (eager generate is bound by the host CPU).

    python benchmarks/bench_generate.py --layers 32 --batch 32 --prompt 128 --new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from punica_hf import MultiLoraModel
from punica_hf.formats import LoraAdapterConfig
from punica_hf.formats import AdapterWeights, ModuleLora

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama_8b_shape(layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096, pad_token_id=0,
    )


def random_adapter(model: torch.nn.Module, rank: int, generator: torch.Generator) -> AdapterWeights:
    """Random LoRA factors for every targeted projection (small B so generations stay finite)."""
    modules = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            lora_a = torch.randn(rank, module.in_features, generator=generator) / module.in_features**0.5
            lora_b = torch.randn(module.out_features, rank, generator=generator) * 0.01
            modules[name] = ModuleLora(lora_a, lora_b)
    config = LoraAdapterConfig(r=rank, lora_alpha=rank)
    return AdapterWeights(modules=modules, config=config, source="random")


def tokens_per_second(generate, batch: int, new_tokens: int, reps: int) -> list[float]:
    generate()  # warm-up at the timed shapes (compiles, caches, kernel builds)
    rates = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate()
        torch.cuda.synchronize()
        rates.append(batch * new_tokens / (time.perf_counter() - start))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (32 = Llama-3-8B)")
    parser.add_argument("--batch", type=int, default=32, help="rows, each with its own adapter")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, default=64, help="generated tokens per row")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank of every adapter")
    parser.add_argument("--reps", type=int, default=2, help="timed repetitions per system")
    parser.add_argument("--peft-mixed-new-tokens", type=int, default=4, help="new tokens for PEFT's slow mixed batch")
    parser.add_argument("--compiled", action="store_true", help="also time static cache + compiled decode")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/bench_generate_h200.json"))
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device("cuda")
    config = llama_8b_shape(args.layers)
    with device:
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
        peft_base = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    peft_base.load_state_dict(model.state_dict())
    input_ids = torch.randint(1, config.vocab_size, (args.batch, args.prompt), device=device)
    attention_mask = torch.ones_like(input_ids)
    common = dict(attention_mask=attention_mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                  do_sample=False)
    compiled = dict(cache_implementation="static")
    results: dict[str, list[float]] = {}

    def run(name, generate, new_tokens=args.new_tokens):
        results[name] = tokens_per_second(generate, args.batch, new_tokens, args.reps)
        print(f"{name:48s} {' '.join(f'{r:8.1f}' for r in results[name])} tokens/s", flush=True)

    run("base, eager", lambda: model.generate(input_ids, **common))
    if args.compiled:
        run("base, static cache + compiled decode", lambda: model.generate(input_ids, **common, **compiled))

    generator = torch.Generator().manual_seed(1)
    adapters = {f"a{i}": random_adapter(model, args.rank, generator) for i in range(args.batch)}
    served = MultiLoraModel(model, max_adapters=args.batch, max_rank=args.rank)
    served.load_adapters(adapters)
    distinct = torch.arange(args.batch, device=device)
    run(f"punica_hf, {args.batch} distinct adapters, eager",
        lambda: served.generate(input_ids, adapter_ids=distinct, **common))
    run("punica_hf, one adapter for all rows, eager",
        lambda: served.generate(input_ids, adapter_ids=torch.zeros_like(distinct), **common))
    if args.compiled:
        run(f"punica_hf, {args.batch} distinct, static + compiled",
            lambda: served.generate(input_ids, adapter_ids=distinct, **common, **compiled))

    lora_config = LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=TARGETS)
    peft_model = get_peft_model(peft_base, lora_config, adapter_name="a0").eval()
    for name in list(adapters)[1:]:
        peft_model.add_adapter(name, lora_config)
    peft_model.load_state_dict(
        {f"base_model.model.{module}.{kind}.{name}.weight": getattr(factors, attr).to(torch.bfloat16)
         for name, weights in adapters.items() for module, factors in weights.modules.items()
         for kind, attr in (("lora_A", "lora_a"), ("lora_B", "lora_b"))},
        strict=False,
    )
    peft_model.set_adapter("a0")
    run("PEFT, one adapter active, eager", lambda: peft_model.generate(input_ids=input_ids, **common))
    mixed = dict(common, max_new_tokens=args.peft_mixed_new_tokens, min_new_tokens=args.peft_mixed_new_tokens)
    run(f"PEFT mixed batch (adapter_names), {args.batch} distinct, eager",
        lambda: peft_model.generate(input_ids=input_ids, adapter_names=list(adapters), **mixed),
        new_tokens=args.peft_mixed_new_tokens)

    base_rate = sorted(results["base, eager"])[len(results["base, eager"]) // 2]
    report = {
        "gpu": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
                     "peft": peft.__version__, "python": platform.python_version()},
        "setup": vars(args) | {"output": str(args.output)},
        "tokens_per_second": results,
        "ratio_to_base_eager": {name: sorted(r)[len(r) // 2] / base_rate for name, r in results.items()},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(json.dumps(report["ratio_to_base_eager"], indent=2))


if __name__ == "__main__":
    main()
