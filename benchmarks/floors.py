"""What an engine step cannot beat on its GPU: the bytes it must move, and the arithmetic it must do.

- **Bytes floor of a decode step** (issue 38's target 2): the model's weights read once plus the batch's KV cache
  read once (``StepRecord.key_tokens`` times one token's keys and values over every layer), at the GPU's copy
  bandwidth measured in the same run (``copy_bandwidth``: bytes read plus bytes written, per second). The weights
  are every parameter, as the issue states the floor; a decode step reads only its tokens' rows of the input
  embedding table, so ``floor_ms_without_input_embeddings`` is the stricter floor.
- **FLOP floor of a prefill step** (target 3b): 2 x the parameters a token multiplies (every one but the input
  embedding, a lookup) x the step's tokens, at the GPU's dense bf16 peak from its datasheet (``DENSE_BF16_PEAK``).
  The attention's own FLOPs are left out: a lower bound.
"""

from __future__ import annotations

import torch

# Datasheet dense (no sparsity) bf16 tensor-core peaks, FLOP/s, by a part of the device name.
DENSE_BF16_PEAK = {"H100": 989e12, "H200": 989e12}


def copy_bandwidth(device: torch.device, gib: int = 1, repeats: int = 10) -> float | None:
    """The bytes per second (read plus written) of the fastest of ``repeats`` device-to-device copies of ``gib``
    GiB; None off CUDA."""
    if device.type != "cuda":
        return None
    source = torch.empty(gib << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # the first copy pays for nothing else
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fastest = float("inf")
    for _ in range(repeats):
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        fastest = min(fastest, start.elapsed_time(end) / 1e3)
    del source, target
    torch.cuda.empty_cache()
    return 2 * (gib << 30) / fastest


def parameter_bytes(hf_model) -> tuple[int, int]:
    """(every parameter's bytes, the input embedding table's bytes; 0 where it is tied to the output layer, whose
    step reads it whole)."""
    total = sum(p.numel() * p.element_size() for p in hf_model.parameters())
    embedding = hf_model.get_input_embeddings().weight
    output = hf_model.get_output_embeddings()
    tied = output is not None and output.weight is embedding
    return total, 0 if tied else embedding.numel() * embedding.element_size()


def kv_bytes_per_token(hf_model) -> int:
    """One token's keys and values over every layer, in the model's dtype."""
    config = hf_model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * hf_model.dtype.itemsize


def decode_bytes_floor(hf_model, key_tokens: float, bandwidth: float) -> dict:
    """The bytes floor of a decode step whose attention reads ``key_tokens`` tokens' keys and values."""
    weights, input_embeddings = parameter_bytes(hf_model)
    kv = key_tokens * kv_bytes_per_token(hf_model)
    return {"weights_gb": weights / 1e9, "input_embeddings_gb": input_embeddings / 1e9, "kv_gb": kv / 1e9,
            "key_tokens": key_tokens, "bandwidth_tb_per_s": bandwidth / 1e12,
            "floor_ms": 1e3 * (weights + kv) / bandwidth,
            "floor_ms_without_input_embeddings": 1e3 * (weights - input_embeddings + kv) / bandwidth}


def prefill_flop_floor(hf_model, tokens: float, device_name: str) -> dict | None:
    """The FLOP floor of a step of ``tokens`` prompt tokens; None for a GPU without a datasheet peak here."""
    peak = next((flops for part, flops in DENSE_BF16_PEAK.items() if part in device_name), None)
    if peak is None:
        return None
    weights, input_embeddings = parameter_bytes(hf_model)
    multiplied = (weights - input_embeddings) / hf_model.dtype.itemsize  # parameters a token multiplies
    flops = 2 * multiplied * tokens
    return {"tokens": tokens, "tflop": flops / 1e12, "peak_tflop_per_s": peak / 1e12, "floor_ms": 1e3 * flops / peak}


def against_floor(step: dict, floor: dict | None) -> dict | None:
    """``step`` (``median_ms``, ``median_device_ms``) over ``floor``'s ``floor_ms``: the ratios, with the floor's
    arithmetic."""
    if floor is None or not step.get("median_ms"):
        return None
    device_ms = step.get("median_device_ms")
    return {"step_ms": step["median_ms"], "device_ms": device_ms, **floor,
            "ratio": step["median_ms"] / floor["floor_ms"],
            "device_ratio": None if device_ms is None else device_ms / floor["floor_ms"]}
