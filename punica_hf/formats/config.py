"""PEFT ``adapter_config.json`` -> the few settings serving needs, with PEFT's scaling rules.

The config decides each module's rank and alpha (``rank_pattern`` / ``alpha_pattern``) and thus its scaling, and
with PEFT's module selection (``target_modules``, ``exclude_modules``, ``layers_to_transform`` / ``layers_pattern``,
applied to a base model's module names by ``matching``) which of the checkpoint's weights apply. Every field read
here is type-checked (a ``ValueError`` names the field and the value it got); features that would change the math
and are not implemented are refused by name rather than silently ignored.

The config is also read by peft's own ``LoraConfig``: settings it knows are checked by its rules (and its
module selection decides which modules of a base model the adapter changes, see ``matching``); a setting it does
not know (written by a newer peft) is ignored when unset and refused when set, since serving cannot tell whether
it changes the math. Only the JSON is read: nothing in a checkpoint is run, and nothing is fetched.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from peft import LoraConfig

# Flags of served features (true/false/null), the bias settings served (PEFT's others: none), and the config keys
# of PEFT features punica_hf does not implement, refused whenever set (null, [] and {} mean unset, as in PEFT).
_FLAGS = ("use_dora", "lora_bias")
_SERVED_BIAS = (None, "none", "lora_only", "all")
_REFUSED_SETTINGS = {
    "modules_to_save": "modules_to_save",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "megatron_config": "Megatron layers (megatron_config)",
    # LoRA variants whose forward is not plain LoRA (peft's lora_variants); VeLoRA and MiCA change training only
    "use_qalora": "QALoRA (use_qalora=True)",
    "arrow_config": "Arrow routing (arrow_config)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "kasa_config": "KaSA (kasa_config)",
}
# Read by peft's LoraConfig itself only at run time and dropped from saved configs; peft ignores it when loading too.
_RUNTIME_ONLY = {"runtime_config"}

# Far beyond any trained adapter (ranks up to a few thousand, alphas up to a few thousand): a larger value is a
# corrupt or mistyped config, and an alpha near the float range gives factors that overflow the model's dtype.
LARGEST_RANK = 1 << 16
LARGEST_ABS_ALPHA = 1e6
_ALPHA_RANGE = f"at most {LARGEST_ABS_ALPHA:g} in magnitude"


@dataclass(frozen=True)
class LoraAdapterConfig:
    """The settings of one LoRA adapter; every field is checked when the config is made (``ValueError``)."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    base_model_name_or_path: str | None = None
    # aLoRA: the adapter applies from the start of the last occurrence of these tokens in a row's input on
    alora_invocation_tokens: tuple[int, ...] | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # The config as peft reads it (from_dict); None for a config made in code, whose adapter's weights alone say
    # which modules it changes.
    peft_config: LoraConfig | None = field(default=None, compare=False, repr=False)
    # (compiled pattern, value) per rank_pattern / alpha_pattern entry, in order: a bad regex fails at load
    _rank_rules: tuple[tuple[re.Pattern, int], ...] = field(init=False, compare=False, repr=False)
    _alpha_rules: tuple[tuple[re.Pattern, float], ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        _require(_is_rank(self.r), "r", "a positive integer", self.r)
        _require(_in_rank_range(self.r), "r", f"at most {LARGEST_RANK}", self.r)
        _require(_is_finite_number(self.lora_alpha), "lora_alpha", "a finite number", self.lora_alpha)
        _require(_in_alpha_range(self.lora_alpha), "lora_alpha", _ALPHA_RANGE, self.lora_alpha)
        _require(isinstance(self.use_rslora, bool), "use_rslora", "true or false", self.use_rslora)
        _require(
            self.base_model_name_or_path is None or isinstance(self.base_model_name_or_path, str),
            "base_model_name_or_path", "a string or null", self.base_model_name_or_path,
        )
        if isinstance(self.alora_invocation_tokens, list):  # frozen, hashable: a tuple
            object.__setattr__(self, "alora_invocation_tokens", tuple(self.alora_invocation_tokens))
        _require(
            self.alora_invocation_tokens is None or _is_token_ids(self.alora_invocation_tokens),
            "alora_invocation_tokens", "a non-empty list of token ids (integers >= 0) or null",
            self.alora_invocation_tokens,
        )
        rank_checks = ((_is_rank, "a positive integer"), (_in_rank_range, f"at most {LARGEST_RANK}"))
        alpha_checks = ((_is_finite_number, "a finite number"), (_in_alpha_range, _ALPHA_RANGE))
        rank_rules = _compile_patterns("rank_pattern", self.rank_pattern, rank_checks)
        alpha_rules = _compile_patterns("alpha_pattern", self.alpha_pattern, alpha_checks)
        object.__setattr__(self, "_rank_rules", rank_rules)
        object.__setattr__(self, "_alpha_rules", alpha_rules)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "LoraAdapterConfig":
        """Validate a PEFT LoRA config dict. Keys serving does not need (newer PEFT versions) are ignored."""
        if not isinstance(raw, dict):
            raise ValueError(f"adapter config must be a JSON object, got {type(raw).__name__}")
        peft_type = raw.get("peft_type")
        if not (isinstance(peft_type, str) and peft_type.upper() == "LORA"):
            raise ValueError(f"only LoRA adapters are supported, this config has peft_type={peft_type!r}")
        _refuse_unsupported_features(raw)
        _check_selection_settings(raw)
        checked = cls(
            r=raw.get("r", 8),  # PEFT's defaults for keys that are absent; null stays null and is refused
            lora_alpha=raw.get("lora_alpha", 8),
            use_rslora=_unless_null(raw, "use_rslora", False),
            rank_pattern=_unless_null(raw, "rank_pattern", {}),
            alpha_pattern=_unless_null(raw, "alpha_pattern", {}),
            base_model_name_or_path=raw.get("base_model_name_or_path"),
            alora_invocation_tokens=_unless_empty(raw.get("alora_invocation_tokens")),
            raw=dict(raw),
        )
        # peft's rules after ours: ours name the field and the value it got
        return dataclasses.replace(checked, peft_config=_read_with_peft(raw))

    @classmethod
    def from_file(cls, path: str | Path) -> "LoraAdapterConfig":
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"adapter config {path} is not valid JSON text (UTF-8): {error}") from None
        try:
            return cls.from_dict(raw)
        except ValueError as error:
            raise ValueError(f"adapter config {path}: {error}") from None

    def rank_for(self, module_name: str) -> int:
        """The rank PEFT gives ``module_name`` (a module path of the base model)."""
        return _pattern_value(self._rank_rules, module_name, self.r)

    def scaling_for(self, module_name: str) -> float:
        """``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA, after ``rank_pattern`` / ``alpha_pattern``."""
        rank = self.rank_for(module_name)
        alpha = float(_pattern_value(self._alpha_rules, module_name, self.lora_alpha))
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _require(condition: bool, name: str, expected: str, value: Any) -> None:
    if not condition:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _is_rank(value: Any) -> bool:
    # bool is an int subclass, but `True` is not a rank
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _in_rank_range(rank: int) -> bool:
    return rank <= LARGEST_RANK


def _in_alpha_range(alpha: float) -> bool:
    return abs(alpha) <= LARGEST_ABS_ALPHA


def _is_names(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(item, str) for item in value))


def _is_layer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _is_layers(value: Any) -> bool:
    return _is_layer(value) or (isinstance(value, list) and all(map(_is_layer, value)))


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) > 0 and all(map(_is_layer, value))  # ids are ints >= 0 as layers


def _unless_empty(value: Any) -> Any:
    return None if isinstance(value, list) and not value else value  # [] is unset, as in PEFT


def _is_dropout(value: Any) -> bool:
    return _is_finite_number(value) and 0 <= value <= 1


# Settings PEFT chooses the targeted modules with, and its training-only dropout: {key: (what a valid value is,
# its check)}. Null is unset.
_SELECTION_SETTINGS = {
    "target_modules": ("a string (a regular expression) or a list of strings", _is_names),
    "exclude_modules": ("a string (a regular expression) or a list of strings", _is_names),
    "layers_pattern": ("a string or a list of strings", _is_names),
    "layers_to_transform": ("a layer index (an integer >= 0) or a list of them", _is_layers),
    "fan_in_fan_out": ("true or false", lambda value: isinstance(value, bool)),
    "lora_dropout": ("a number from 0 to 1", _is_dropout),
}


def _check_selection_settings(raw: dict[str, Any]) -> None:
    for key, (expected, is_valid) in _SELECTION_SETTINGS.items():
        value = raw.get(key)
        _require(value is None or is_valid(value), key, expected, value)
    for key in ("target_modules", "exclude_modules"):  # a string is a regular expression, matched as is
        if isinstance(raw.get(key), str):
            try:
                re.compile(raw[key])
            except re.error as error:
                raise ValueError(f"{key} {raw[key]!r} is not a valid regular expression: {error}") from None


def _unless_null(raw: dict[str, Any], key: str, default: Any) -> Any:
    value = raw.get(key)
    return default if value is None else value


def _compile_patterns(name: str, patterns: Any, checks) -> tuple[tuple[re.Pattern, Any], ...]:
    """``patterns`` ({regex: value}) checked and compiled the way PEFT matches them against module names.

    ``checks``: ``(is_valid, what a valid value is)`` pairs, in order, each value passing the ones before it."""
    _require(isinstance(patterns, dict), name, "a JSON object {pattern: value}", patterns)
    rules = []
    for pattern, value in patterns.items():
        _require(isinstance(pattern, str), f"{name} key", "a string", pattern)
        for is_valid, expected in checks:
            _require(is_valid(value), f"{name}[{pattern!r}]", expected, value)
        try:
            # PEFT's rule: a pattern matches the end of the module name at a "." boundary
            rules.append((re.compile(rf"(.*\.)?({pattern})$"), value))
        except re.error as error:
            raise ValueError(f"{name} key {pattern!r} is not a valid regular expression: {error}") from None
    return tuple(rules)


def _pattern_value(rules: tuple[tuple[re.Pattern, Any], ...], module_name: str, default: Any) -> Any:
    # PEFT's rule: the first pattern that matches wins
    for pattern, value in rules:
        if pattern.match(module_name):
            return value
    return default


def _refuse_unsupported_features(raw: dict[str, Any]) -> None:
    for key in _FLAGS:
        flag = raw.get(key)
        _require(flag is None or isinstance(flag, bool), key, "true or false", flag)
    for key, feature in _REFUSED_SETTINGS.items():
        if raw.get(key):
            raise ValueError(f"{feature} is not supported by punica_hf yet")
    _check_target_parameters(raw)
    bias = raw.get("bias")
    _require(bias is None or isinstance(bias, str), "bias", "a string ('none', 'lora_only' or 'all')", bias)
    if bias not in _SERVED_BIAS:
        raise ValueError(f"bias={bias!r} is not supported by punica_hf (only 'none', 'lora_only' and 'all')")


def _check_target_parameters(raw: dict[str, Any]) -> None:
    """``target_parameters`` (LoRA on MoE experts' fused weights): names of the form ``module.parameter``."""
    targets = raw.get("target_parameters")
    if not targets:
        return
    _require(
        isinstance(targets, list) and all(isinstance(name, str) and "." in name.strip(".") for name in targets),
        "target_parameters", "a list of 'module.parameter' names (e.g. 'experts.gate_up_proj')", targets,
    )
    # PEFT's ParamWrapper refuses these: dropout cannot be factored out of W + dW, and DoRA, lora_B's bias,
    # fan_in_fan_out and aLoRA are not implemented for wrapped parameters
    for setting, refused in (("lora_dropout", "lora_dropout != 0"), ("use_dora", "use_dora=True"),
                             ("lora_bias", "lora_bias=True"), ("fan_in_fan_out", "fan_in_fan_out=True"),
                             ("alora_invocation_tokens", "aLoRA (alora_invocation_tokens)")):
        if raw.get(setting):
            raise ValueError(f"target_parameters with {refused} is refused by PEFT")


def _read_with_peft(raw: dict[str, Any]) -> LoraConfig:
    """``raw`` as peft's ``LoraConfig``, built from the dict (peft's ``from_pretrained`` could reach the Hub)."""
    # Imported here: peft (and the bitsandbytes it loads) takes seconds to import, a cost for PEFT configs only
    import peft
    from peft import LoraConfig

    known = {item.name for item in dataclasses.fields(LoraConfig) if item.init} - _RUNTIME_ONLY
    unknown = sorted(key for key in raw if key not in known and key not in _RUNTIME_ONLY and _is_set(raw[key]))
    if unknown:
        written_by = raw.get("peft_version") or "an unknown version"
        raise ValueError(
            f"settings {unknown} are unknown to the installed peft {peft.__version__} (the adapter was saved by peft "
            f"{written_by}); they may change the adapter's math: install a peft that knows them"
        )
    try:
        with warnings.catch_warnings():
            # peft warns about settings it ignores when loading (an unused loftq_config, say): nothing to act on
            warnings.simplefilter("ignore")
            return LoraConfig(**{key: value for key, value in raw.items() if key in known})
    except (ValueError, TypeError, ImportError) as error:
        raise ValueError(f"peft refuses this LoRA config: {error}") from None


def _is_set(value: Any) -> bool:
    # As in PEFT's configs, null, false, [] and {} leave a feature off
    return value not in (None, False, [], {}, "")
