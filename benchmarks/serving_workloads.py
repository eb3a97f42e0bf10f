"""What ``bench_serving.py`` serves: the request streams, adapter sets and models of its default run and of the
workloads its options select (``--mixed-ranks``, ``--long-prompts``, ``--shared-prefixes``, ``--small-model``),
and each workload's systems. Nothing here measures."""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from bench_generate import build_llama, llama_3_2_1b_config, llama_config, random_adapter
from transformers import LlamaConfig, LlamaForCausalLM

from punica_hf import MultiLoraModel
from punica_hf.ops import KernelConfig
from punica_hf.formats import AdapterWeights


@dataclass(frozen=True)
class LengthMix:
    """Log-normal lengths, clipped: ``median * exp(sigma * N(0, 1))`` in ``[low, high]``."""

    median: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        return int(min(max(round(rng.lognormvariate(0, self.sigma) * self.median), self.low), self.high))


FULL = dict(prompts=LengthMix(200, 0.8, 16, 1024), outputs=LengthMix(128, 0.7, 8, 512))
TINY = dict(prompts=LengthMix(24, 0.8, 4, 96), outputs=LengthMix(16, 0.7, 2, 48))
# RAG-like: long retrieved contexts, the default outputs. The tiny prompts fill the CPU's 256-token step budget.
LONG_PROMPTS = dict(prompts=LengthMix(1500, 0.5, 256, 3500), outputs=FULL["outputs"])
LONG_PROMPTS_TINY = dict(prompts=LengthMix(120, 0.5, 24, 240), outputs=TINY["outputs"])
# Shared system prompts: each adapter's prefix, then a short user part. A KV page holds 256 tokens, so the tiny
# prefix is one full page (shorter would never be shared).
SHARED_PREFIX = dict(prefix=1024, user=LengthMix(64, 0.7, 8, 256), outputs=FULL["outputs"])
SHARED_PREFIX_TINY = dict(prefix=256, user=LengthMix(16, 0.7, 4, 48), outputs=TINY["outputs"])
MIXED_RANKS = (8, 16, 32, 64)
MIXED_RANKS_TINY = (2, 4, 8, 16)


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    new_tokens: int
    adapter_index: int  # which adapter of a system's set (taken modulo the set's size)


def make_requests(count: int, vocab: int, mix: dict, seed: int) -> list[Request]:
    """Random prompts of ``mix``'s lengths, each on an adapter drawn uniformly."""
    rng = random.Random(seed)
    return [
        Request([rng.randrange(1, vocab) for _ in range(mix["prompts"].draw(rng))], mix["outputs"].draw(rng),
                rng.randrange(1 << 30))
        for _ in range(count)
    ]


def zipf_requests(count: int, vocab: int, mix: dict, adapters: int, exponent: float, seed: int) -> list[Request]:
    """``make_requests``' prompts and lengths, each on one of ``adapters`` drawn with Zipf popularity (the k-th most
    popular with weight ``k ** -exponent``; the popularity order shuffled, so it is not the order of the ranks)."""
    rng = random.Random(seed)
    by_popularity = rng.sample(range(adapters), adapters)
    weights = [(k + 1) ** -exponent for k in range(adapters)]
    chosen = rng.choices(by_popularity, weights, k=count)
    return [Request(r.prompt, r.new_tokens, index)
            for r, index in zip(make_requests(count, vocab, mix, seed + 1), chosen)]


def shared_prefix_requests(count: int, vocab: int, mix: dict, adapters: int, seed: int) -> list[Request]:
    """Each of ``adapters`` adapters has a system prompt of ``mix["prefix"]`` tokens; a request is its adapter's
    system prompt followed by a user part of its own (adapters drawn uniformly)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, vocab) for _ in range(mix["prefix"])] for _ in range(adapters)]
    requests = []
    for _ in range(count):
        adapter = rng.randrange(adapters)
        user = [rng.randrange(1, vocab) for _ in range(mix["user"].draw(rng))]
        requests.append(Request(prefixes[adapter] + user, mix["outputs"].draw(rng), adapter))
    return requests


def mixed_rank_adapters(base: torch.nn.Module, count: int, ranks: tuple[int, ...], generator: torch.Generator,
                        sets_per_rank: int = 2) -> dict[str, AdapterWeights]:
    """``count`` adapters named ``m0, m1, ...``, adapter i of rank ``ranks[i % len(ranks)]``. Random factors are drawn
    for ``sets_per_rank`` adapters of each rank and reused past that: distinct names, slots and transfers, shared
    host values (120 distinct Llama-3-8B adapters of these ranks would take ~19 GB of host memory to no purpose)."""
    factor_sets = {rank: [random_adapter(base, rank, generator) for _ in range(sets_per_rank)] for rank in ranks}
    return {f"m{i}": factor_sets[ranks[i % len(ranks)]][(i // len(ranks)) % sets_per_rank] for i in range(count)}


def build_base(args) -> tuple[LlamaForCausalLM, LlamaConfig]:
    """The base model: Llama-3-8B-shaped (``--layers``; Llama-3.2-1B-shaped for ``--small-model``) with random
    weights on the GPU, or tiny on the CPU."""
    torch.manual_seed(0)
    if args.tiny:
        config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                             pad_token_id=0)
        with torch.device("cpu"):
            base = LlamaForCausalLM(config).to(torch.float32).eval()
    else:
        config = llama_3_2_1b_config() if args.workload == "small-model" else llama_config(args.layers)
        base = build_llama(config, torch.device("cuda"))
    base.generation_config.eos_token_id = None  # random weights: no request stops before its length
    return base, config


def kernel_config(text: str) -> KernelConfig:
    """The ``KernelConfig`` of a ``--kernels`` option: ``name=true|false`` pairs, comma-separated, the rest the
    defaults."""
    settings = dict(pair.split("=", 1) if "=" in pair else (pair, "") for pair in text.split(",") if pair)
    if any(value.lower() not in ("true", "false") for value in settings.values()):
        raise SystemExit(f"--kernels: name=true or name=false, comma-separated; got {text!r}")
    try:
        return KernelConfig(**{name: value.lower() == "true" for name, value in settings.items()})
    except TypeError as error:  # a name KernelConfig does not have
        raise SystemExit(f"--kernels: {error}") from None


def build_model(args) -> tuple[MultiLoraModel, dict[int, list[str]], LlamaConfig]:
    """The base model wrapped, with ``max(--adapters)`` adapters registered as a0, a1, ... (the distinct random
    factors are ``min(--adapters)`` sets, reused past that: distinct names, slots and transfers, shared values)."""
    base, config = build_base(args)
    device = base.device
    counts = sorted(args.adapters)
    generator = torch.Generator(device).manual_seed(1)  # drawn on the GPU: 32 8B-shaped adapters in seconds
    factors = [random_adapter(base, args.rank, generator) for _ in range(counts[0])]
    model = MultiLoraModel(base, max_adapters=args.max_adapters, max_rank=args.rank,
                           kernels=getattr(args, "kernels", None))
    names = [f"a{i}" for i in range(counts[-1])]
    model.load_adapters({name: factors[i % len(factors)] for i, name in enumerate(names)})
    return model, {count: names[:count] for count in counts}, config


@dataclass(frozen=True)
class System:
    """An engine system of a workload option: the adapters its requests take in turn (``None``: the base model)
    and whether its engine caches prefixes."""

    name: str
    adapters: list[str | None]
    prefix_caching: bool = True


def workload_setup(args: argparse.Namespace) -> tuple[MultiLoraModel, list[System], Callable[[int], list[Request]]]:
    """The model, the systems and the request stream (by seed) of ``args.workload``."""
    tiny, count = args.tiny, args.adapters[0]
    if args.workload == "mixed-ranks":
        base, config = build_base(args)
        ranks = MIXED_RANKS_TINY if tiny else MIXED_RANKS
        model = MultiLoraModel(base, max_adapters=args.max_adapters, max_rank=max(ranks),
                               kernels=getattr(args, "kernels", None))
        adapters = mixed_rank_adapters(base, count, ranks, torch.Generator(base.device).manual_seed(1))
        model.load_adapters(adapters)
        systems = [System(f"engine, {count} adapters of ranks {ranks[0]}-{ranks[-1]}", list(adapters)),
                   System("engine, base model", [None])]
        mix = TINY if tiny else FULL
        return model, systems, lambda seed: zipf_requests(args.requests, config.vocab_size, mix, count, args.zipf, seed)
    model, adapter_sets, config = build_model(args)
    names = adapter_sets[count]
    if args.workload in ("long-prompts", "small-model"):
        mix = {"long-prompts": (LONG_PROMPTS, LONG_PROMPTS_TINY), "small-model": (FULL, TINY)}[args.workload][tiny]
        systems = [System(f"engine, {count} adapters", names), System("engine, base model", [None])]
        return model, systems, lambda seed: make_requests(args.requests, config.vocab_size, mix, seed)
    mix = SHARED_PREFIX_TINY if tiny else SHARED_PREFIX
    systems = [System(f"engine, {count} adapters, prefix caching {'on' if on else 'off'}", names, prefix_caching=on)
               for on in (True, False)]
    return model, systems, lambda seed: shared_prefix_requests(args.requests, config.vocab_size, mix, count, seed)
