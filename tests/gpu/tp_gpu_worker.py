"""One rank of tests/gpu/test_tp_gpu.py: run under ``torchrun --nproc-per-node 2`` by that test, never alone.

``python tp_gpu_worker.py ROOT DEVICE``: ROOT holds the tiny model (``ROOT/model``) and its PEFT adapters
(``ROOT/adapters/<name>``). Both ranks run on ONE device (``cuda``: GPU 0, in bf16 with the CUDA LoRA kernels;
``cpu``: the same calls on the CPU, to check this harness where there is no GPU), over gloo: NCCL refuses two ranks
on one GPU, gloo carries CUDA tensors through host copies. Each rank runs the model split over the 2 ranks and the
unsplit model, with ``generate(adapter_ids=...)`` and with the serving engine, and writes what it saw to
``ROOT/rank<R>.json``; the test compares (the tolerances live there).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

os.environ["LOCAL_RANK"] = "0"  # transformers puts rank R on device LOCAL_RANK: both ranks on the one GPU

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, DistributedConfig  # noqa: E402

from punica_hf import MultiLoraModel  # noqa: E402
from punica_hf.serving import Engine, EngineConfig, SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from two_ranks import finish_rank  # noqa: E402

ROOT = Path(sys.argv[1])
DEVICE = torch.device(sys.argv[2])
RANK = int(os.environ["RANK"])
BACKEND = "cuda" if DEVICE.type == "cuda" else "torch"
PROMPTS = [[5, 17, 33, 2, 9, 41], [7, 7, 12, 60, 3, 11], [1, 2, 3, 4, 5, 6], [88, 14, 29, 70, 51, 8]]
ROW_ADAPTERS = ["attn", None, "mlp", "attn"]  # mixed adapters (r 4 and 8) and a base row
NEW_TOKENS = 8


def tp_plan() -> dict[str, str]:
    """The model's own plan, but lm_head whole on every rank.

    Its own plan gathers lm_head's output (a DTensor all-gather), and gloo's all-gather of CUDA tensors segfaults
    (pytorch/pytorch#152645); the layers LoRA serves under TP (q, k, v, o, gate, up, down) keep their styles. The
    whole plan is spelled out: transformers 5.17 takes a dict as the plan, later releases as overrides of it.
    """
    config = AutoConfig.from_pretrained(ROOT / "model")
    return {**{f"model.{name}": style for name, style in config.base_model_tp_plan.items()},
            "lm_head": "replicated_with_grad_allreduce"}


def wrapped(tensor_parallel: bool) -> MultiLoraModel:
    """The model (split over the ranks, or whole on DEVICE) in bf16 with both adapters loaded."""
    if tensor_parallel:
        base = AutoModelForCausalLM.from_pretrained(ROOT / "model", dtype=torch.bfloat16,
                                                    distributed_config=DistributedConfig(tp_plan=tp_plan()))
    else:
        base = AutoModelForCausalLM.from_pretrained(ROOT / "model", dtype=torch.bfloat16).to(DEVICE)
    model = MultiLoraModel(base.eval(), max_adapters=4, max_rank=16, backend=BACKEND)
    model.load_adapters({name: ROOT / "adapters" / name for name in ("attn", "mlp")})
    return model


def top2_gaps(model: MultiLoraModel, prompt: list[int], tokens: list[int], adapter: str | None) -> list[float]:
    """The whole model's gap between its two best scores before each of ``tokens`` (teacher-forced): where it is
    tiny, bf16 rounding may pick either token."""
    ids = torch.tensor([prompt + tokens], device=DEVICE)
    with torch.no_grad():
        logits = model(ids, adapter_ids=[adapter]).logits[0, len(prompt) - 1:-1].float()
    best = logits.topk(2, dim=-1).values
    return (best[:, 0] - best[:, 1]).tolist()


def compare_generate(split: MultiLoraModel, whole: MultiLoraModel, results: dict) -> None:
    """(a) logits and greedy tokens of ``generate(adapter_ids=...)``, split against whole."""
    prompts = torch.tensor(PROMPTS, device=DEVICE)
    with torch.no_grad():
        expected = whole(prompts, adapter_ids=ROW_ADAPTERS).logits.float()
        results["logits_difference"] = (split(prompts, adapter_ids=ROW_ADAPTERS).logits.float() - expected).abs().max().item()
        results["logits_scale"] = expected.abs().max().item()
        results["lora_effect"] = (whole(prompts).logits.float() - expected).abs().max().item()
    greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    tokens = split.generate(prompts, adapter_ids=ROW_ADAPTERS, **greedy)[:, prompts.shape[1]:].tolist()
    expected_tokens = whole.generate(prompts, adapter_ids=ROW_ADAPTERS, **greedy)[:, prompts.shape[1]:].tolist()
    results["tokens"], results["expected_tokens"] = tokens, expected_tokens
    results["gaps"] = [top2_gaps(whole, prompt, row, adapter)
                       for prompt, row, adapter in zip(PROMPTS, expected_tokens, ROW_ADAPTERS)]


def serve(model: MultiLoraModel, results: dict, submit: bool) -> None:
    """(b) the serving engine over ``model``: the prompts with their adapters (rank 0 submits; a follower runs
    rank 0's steps until its shutdown)."""
    engine = Engine(model, config=EngineConfig(max_running=4, kv_blocks=64)).start()
    if submit:
        params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        handles = [engine.submit(prompt, adapter, params) for prompt, adapter in zip(PROMPTS, ROW_ADAPTERS)]
        results["tokens"] = [list(handle.result(timeout=120).token_ids) for handle in handles]
        results["cuda_graphs"] = engine.stats().cuda_graphs
    engine.shutdown(timeout=120)
    results["engine_error"] = None if engine.error is None else str(engine.error)


def main() -> None:
    results: dict = {}
    try:
        if DEVICE.type == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("gloo")  # before transformers, which would pick NCCL for CUDA
        split, whole = wrapped(tensor_parallel=True), wrapped(tensor_parallel=False)
        results["split_device"] = str(split.model.device)
        results["split_layers"] = sorted({name.split(".")[-1] for name, module in split.model.named_modules()
                                          if isinstance(getattr(module, "weight", None), DTensor)})
        compare_generate(split, whole, results.setdefault("generate", {}))
        serve(split, results.setdefault("engine", {}), submit=RANK == 0)
        if RANK == 0:
            unsplit = results.setdefault("unsplit_engine", {})
            serve(whole, unsplit, submit=True)
            unsplit["gaps"] = [top2_gaps(whole, prompt, row, adapter)
                               for prompt, row, adapter in zip(PROMPTS, unsplit["tokens"], ROW_ADAPTERS)]
        results["engine_error"] = results["engine"]["engine_error"]
    except Exception:
        results["error"] = traceback.format_exc()
    finish_rank(ROOT, results)


if __name__ == "__main__":
    main()
