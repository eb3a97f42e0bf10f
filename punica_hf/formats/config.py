"""PEFT ``adapter_config.json`` -> the few settings serving needs, with PEFT's scaling rules.

Which modules an adapter changes is read off its weights (that is what PEFT loads too); the config decides
each module's rank and alpha (``rank_pattern`` / ``alpha_pattern``) and thus its scaling. Features that
would change the math and are not implemented are refused by name rather than silently ignored.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LoraAdapterConfig:
    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    base_model_name_or_path: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "LoraAdapterConfig":
        """Validate a PEFT LoRA config dict. Unknown keys (newer PEFT versions) are ignored."""
        if not isinstance(raw, dict):
            raise ValueError(f"adapter config must be a JSON object, got {type(raw).__name__}")
        peft_type = str(raw.get("peft_type", "")).upper()
        if peft_type != "LORA":
            raise ValueError(f"only LoRA adapters are supported, this config has peft_type={raw.get('peft_type')!r}")
        _refuse_unsupported_features(raw)
        return cls(
            r=int(raw.get("r", 8)),
            lora_alpha=float(raw.get("lora_alpha", 8)),
            use_rslora=bool(raw.get("use_rslora", False)),
            rank_pattern={k: int(v) for k, v in (raw.get("rank_pattern") or {}).items()},
            alpha_pattern={k: float(v) for k, v in (raw.get("alpha_pattern") or {}).items()},
            base_model_name_or_path=raw.get("base_model_name_or_path"),
            raw=dict(raw),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "LoraAdapterConfig":
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"adapter config {path} is not valid JSON: {error}") from None
        return cls.from_dict(raw)

    def rank_for(self, module_name: str) -> int:
        """The rank PEFT gives ``module_name`` (a module path of the base model)."""
        return int(_pattern_value(self.rank_pattern, module_name, self.r))

    def scaling_for(self, module_name: str) -> float:
        """``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA, after ``rank_pattern`` / ``alpha_pattern``."""
        rank = self.rank_for(module_name)
        alpha = float(_pattern_value(self.alpha_pattern, module_name, self.lora_alpha))
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _pattern_value(patterns: dict[str, Any], module_name: str, default: Any) -> Any:
    # PEFT's rule: the first pattern that matches the end of the name at a "." boundary wins.
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module_name):
            return value
    return default


def _refuse_unsupported_features(raw: dict[str, Any]) -> None:
    refusals = {
        "use_dora": "DoRA (use_dora=True)",
        "lora_bias": "LoRA bias (lora_bias=True)",
        "modules_to_save": "modules_to_save",
        "layer_replication": "layer_replication",
        "target_parameters": "target_parameters (LoRA on nn.Parameter)",
        "trainable_token_indices": "trainable_token_indices",
        "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)",
        "megatron_config": "Megatron layers (megatron_config)",
    }
    for key, feature in refusals.items():
        if raw.get(key):
            raise ValueError(f"{feature} is not supported by punica_hf yet")
    bias = raw.get("bias", "none")
    if bias not in (None, "none"):
        raise ValueError(f"bias={bias!r} is not supported by punica_hf yet (only bias='none')")
