"""Converted adapters: one safetensors file per adapter, holding exactly what the LoRA layers copy into a slot.

A PEFT checkpoint needs work at every load: find the config and weights files, parse every key, look up each
module's rank and scaling in the config and multiply the scaling into B. A converted file stores the result,
``AdapterWeights``, in the layout of the adapter pool: per module ``"<module>.lora_a"`` ``[r, in]`` and
``"<module>.lora_b_t"`` ``[r, out]`` (B transposed, the scaling folded in), so that placing an adapter copies
contiguous rows and transposes nothing (an embedding's ``[r, vocab]`` and ``[r, dim]`` alike); where the adapter
has them, ``"<module>.magnitude"`` (DoRA), ``"<module>.lora_bias"`` (scaling folded in) and ``"<module>.base_bias"``
``[out]``, and a ``bias="all"`` checkpoint's biases of other modules as ``"<module>.bias"``; float32 by default
(bit-identical to loading the PEFT checkpoint) or bf16/fp16 (half the size). Beside them, in its own dtype,
``"<module>.base_weight"`` for each full copy of a base layer that PEFT saved beside an embedding's or lm_head's LoRA
(checked against the base model when loaded into one). Its safetensors metadata say what it is:

- ``format``: ``"punica_hf.lora.v2"``, so any other safetensors file is refused by name (``v1`` files, which held
  ``"<module>.lora_b"`` ``[out, r]``, are still read);
- ``adapter_config``: the source ``adapter_config.json`` (JSON text);
- ``base_model``: the base model it was trained for (from the config, or given at conversion);
- ``modules``: JSON ``{module: [in, out, r]}``, checked against the tensors at load;
- ``parameters`` (only for LoRA on MoE experts, PEFT ``target_parameters``): JSON ``{key: [in, out, r]}`` of the
  factors ``"<key>.parameter_lora_a"`` / ``"<key>.parameter_lora_b"`` as PEFT saved them (unscaled, every expert's
  rank stacked, keyed by PEFT's wrapper), resolved against the base model when loaded into one;
- ``dtype``, ``source`` and ``punica_hf_version``, for people reading the file.

Loading a converted file is reading its tensors and checking them against that metadata; whether the adapter
fits a base model is checked by the adapter store when it is loaded into one (a file for another base model
is refused there and changes nothing).
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .. import __version__
from .config import LoraAdapterConfig
from .weights import AdapterWeights, ModuleLora, _all_finite

FORMAT = "punica_hf.lora.v2"
_READ_FORMATS = {"punica_hf.lora.v1": "lora_b", FORMAT: "lora_b_t"}  # format -> name of its B tensors
_FORMAT_FAMILY = "punica_hf."
SUFFIX = ".safetensors"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_REQUIRED_METADATA = ("adapter_config", "modules")
_BASE_WEIGHT = ".base_weight"
_SAVED_VECTORS = ("magnitude", "lora_bias", "base_bias")  # a model's output vectors are made from these at load
# PEFT target_parameters factors (MoE experts), unscaled and every expert's rank stacked, by PEFT's wrapper key
_PARAMETER_A, _PARAMETER_B = ".parameter_lora_a", ".parameter_lora_b"


def save_converted(
    weights: AdapterWeights,
    path: str | Path,
    base_model: str | None = None,
    dtype: torch.dtype = torch.float32,
    overwrite: bool = False,
) -> Path:
    """Write ``weights`` to ``path`` in the converted format; ``base_model`` overrides the config's base model.
    An existing ``path`` is refused (``FileExistsError``) unless ``overwrite``; factors that ``dtype`` cannot hold
    (float16 holds at most 65504) are refused before anything is written."""
    if dtype not in DTYPES.values():
        raise ValueError(f"converted adapters are stored as float32, bfloat16 or float16, not {dtype}")
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists: remove it, or ask to overwrite it (--overwrite)")
    tensors, shapes, parameter_shapes = {}, {}, {}
    for key, factors in weights.parameters.items():  # as PEFT saved them: resolved against a model at load
        tensors[key + _PARAMETER_A] = factors.lora_a.to(dtype).contiguous()
        tensors[key + _PARAMETER_B] = factors.lora_b.to(dtype).contiguous()
        parameter_shapes[key] = [factors.lora_a.shape[1], factors.lora_b.shape[0], factors.rank]
    for module_name, factors in weights.modules.items():
        tensors[f"{module_name}.lora_a"] = factors.lora_a.to(dtype).contiguous()
        tensors[f"{module_name}.lora_b_t"] = factors.lora_b.T.to(dtype).contiguous()
        shapes[module_name] = [factors.lora_a.shape[1], factors.lora_b.shape[0], factors.rank]
        for vector in _SAVED_VECTORS:
            if getattr(factors, vector) is not None:
                tensors[f"{module_name}.{vector}"] = getattr(factors, vector).to(dtype).contiguous()
    for module_name, bias in weights.other_biases.items():
        tensors[f"{module_name}.bias"] = bias.to(dtype).contiguous()
    for module_name, weight in weights.base_weights.items():
        tensors[module_name + _BASE_WEIGHT] = weight.contiguous()
    for key, tensor in tensors.items():  # a value past the dtype's range became inf: the file would never load
        if not _all_finite(tensor):
            raise ValueError(f"adapter {weights.source}: {key} holds values beyond the range of {dtype} (at most "
                             f"{torch.finfo(dtype).max:.5g}); convert it to a wider dtype (fp32 or bf16)")
    metadata = {
        "format": FORMAT,
        "adapter_config": json.dumps(_config_dict(weights)),
        "modules": json.dumps(shapes),
        **({"parameters": json.dumps(parameter_shapes)} if parameter_shapes else {}),
        "dtype": str(dtype).removeprefix("torch."),
        "source": weights.source,
        "punica_hf_version": __version__,
    }
    base_model = base_model or weights.config.base_model_name_or_path
    if base_model:
        metadata["base_model"] = base_model
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed: an interrupted conversion never leaves a half file under the real name.
    partial = path.with_name(f".{path.name}.partial")
    # safetensors writes through a temporary file of its own, created with mode 0600; the converted file gets the
    # mode open() gives a new file (0o666 less the umask), read off a file created here as open() creates it.
    partial.unlink(missing_ok=True)
    partial.touch()
    try:
        mode = stat.S_IMODE(partial.stat().st_mode)
        save_file(tensors, partial, metadata=metadata)
        os.chmod(partial, mode)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path


def load_converted(path: str | Path) -> AdapterWeights:
    """Read a converted file back into ``AdapterWeights``, factors in the stored dtype (cast when copied to slots).

    Raises ``ValueError`` naming the file and the problem when it is not a readable safetensors file, not in
    this format, or its tensors disagree with its metadata.
    """
    path = Path(path)
    try:
        with safe_open(path, framework="pt", device="cpu") as file:
            metadata = file.metadata() or {}
            _check_metadata(path, metadata)
            tensors = file.get_tensors()
    except SafetensorError as error:
        raise ValueError(f"{path} is not a readable safetensors file (corrupt or truncated?): {error}") from None

    shapes = _json_metadata(path, metadata, "modules")
    try:
        config = LoraAdapterConfig.from_dict(_json_metadata(path, metadata, "adapter_config"))
    except ValueError as error:
        raise ValueError(f"{path}: its adapter_config metadata is refused: {error}") from None
    if metadata.get("base_model"):
        config = dataclasses.replace(config, base_model_name_or_path=metadata["base_model"])
    b_name = _READ_FORMATS[metadata["format"]]
    base_weights = {
        key.removesuffix(_BASE_WEIGHT): tensors.pop(key) for key in list(tensors) if key.endswith(_BASE_WEIGHT)
    }
    other_biases = {
        key.removesuffix(".bias"): tensors.pop(key) for key in list(tensors)
        if key.endswith(".bias") and key.removesuffix(".bias") not in shapes
    }
    parameters = _parameter_factors(path, tensors, _json_metadata(path, metadata, "parameters")
                                    if "parameters" in metadata else {})
    modules = _module_factors(path, tensors, shapes, b_name) if shapes or not parameters else {}
    if not shapes and tensors:
        raise ValueError(f"{path}: tensors not in its module lists: {sorted(tensors)[:3]}")
    return AdapterWeights(modules=modules, config=config, source=str(path), base_weights=base_weights,
                          other_biases=other_biases, parameters=parameters)


def _parameter_factors(path: Path, tensors: dict[str, torch.Tensor],
                       shapes: dict[str, list[int]]) -> dict[str, ModuleLora]:
    """Take each ``parameters`` entry's two tensors out of ``tensors``, checked against ``{key: [in, out, r]}``."""
    parameters = {}
    for key, dims in shapes.items():
        lora_a, lora_b = tensors.pop(key + _PARAMETER_A, None), tensors.pop(key + _PARAMETER_B, None)
        if lora_a is None or lora_b is None:
            raise ValueError(f"{path}: parameter {key} lacks its {_PARAMETER_A if lora_a is None else _PARAMETER_B}")
        if not (isinstance(dims, list) and len(dims) == 3) or [list(lora_a.shape), list(lora_b.shape)] != [
                [dims[2], dims[0]], [dims[1], dims[2]]]:
            raise ValueError(f"{path}: parameter {key} has lora_a {list(lora_a.shape)} and lora_b "
                             f"{list(lora_b.shape)}, its metadata say [in, out, r] = {dims!r}")
        if not (lora_a.is_floating_point() and lora_b.is_floating_point()):
            raise ValueError(f"{path}: parameter {key} has non-float factors ({lora_a.dtype}, {lora_b.dtype})")
        parameters[key] = ModuleLora(lora_a=lora_a, lora_b=lora_b)
    return parameters


def _check_metadata(path: Path, metadata: dict[str, str]) -> None:
    file_format = metadata.get("format")
    if not (file_format or "").startswith(_FORMAT_FAMILY):  # transformers and PEFT write "pt" here
        raise ValueError(
            f"{path} is not a punica_hf converted adapter (metadata format: {file_format!r}); give a PEFT "
            "adapter as its folder, or convert it with `punica-hf convert`"
        )
    if file_format not in _READ_FORMATS:
        raise ValueError(f"{path} has format {file_format!r}; this version of punica_hf reads {sorted(_READ_FORMATS)}")
    missing = [key for key in _REQUIRED_METADATA if key not in metadata]
    if missing:
        raise ValueError(f"{path} is a {file_format} file without the metadata {', '.join(missing)}")


def _json_metadata(path: Path, metadata: dict[str, str], key: str):
    try:
        value = json.loads(metadata[key])
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: metadata {key!r} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: metadata {key!r} must be a JSON object, got {type(value).__name__}")
    return value


def _module_factors(
    path: Path, tensors: dict[str, torch.Tensor], shapes: dict[str, list[int]], b_name: str
) -> dict[str, ModuleLora]:
    """Pair each module's tensors and check them against the ``modules`` metadata ``{module: [in, out, r]}``.

    ``b_name`` is ``lora_b_t`` (``[r, out]``, kept as a transposed view: ``lora_b`` is ``[out, r]`` as everywhere)
    or, in v1 files, ``lora_b``.
    """
    expected_keys = {f"{module}.{factor}" for module in shapes for factor in ("lora_a", b_name)}
    optional_keys = {f"{module}.{vector}" for module in shapes for vector in _SAVED_VECTORS}
    if not expected_keys <= set(tensors) <= expected_keys | optional_keys:
        missing, unexpected = sorted(expected_keys - set(tensors)), sorted(set(tensors) - expected_keys - optional_keys)
        raise ValueError(
            f"{path}: tensors do not match its module list (missing: {missing[:3] or 'none'}, "
            f"unexpected: {unexpected[:3] or 'none'})"
        )
    if not shapes:
        raise ValueError(f"{path} holds no LoRA modules")
    modules = {}
    for module_name, dims in shapes.items():
        if not (isinstance(dims, list) and len(dims) == 3):
            raise ValueError(f"{path}: module {module_name} has dimensions {dims!r}, expected [in, out, r]")
        lora_a, lora_b = tensors[f"{module_name}.lora_a"], tensors[f"{module_name}.{b_name}"]
        if b_name == "lora_b_t":
            lora_b = lora_b.T
        in_features, out_features, rank = dims
        if list(lora_a.shape) != [rank, in_features] or list(lora_b.shape) != [out_features, rank]:
            raise ValueError(
                f"{path}: module {module_name} has lora_a {list(lora_a.shape)} and lora_b {list(lora_b.shape)}, "
                f"its metadata say [r, in] = {[rank, in_features]} and [out, r] = {[out_features, rank]}"
            )
        if not (lora_a.is_floating_point() and lora_b.is_floating_point()):
            raise ValueError(f"{path}: module {module_name} has non-float factors ({lora_a.dtype}, {lora_b.dtype})")
        vectors = {vector: tensors[f"{module_name}.{vector}"] for vector in _SAVED_VECTORS
                   if f"{module_name}.{vector}" in tensors}
        if not all(vector.is_floating_point() for vector in vectors.values()):
            raise ValueError(f"{path}: module {module_name} has non-float vectors ({sorted(vectors)})")
        try:
            modules[module_name] = ModuleLora(lora_a=lora_a, lora_b=lora_b, **vectors)
        except ValueError as error:
            raise ValueError(f"{path}: module {module_name}: {error}") from None
    return modules


def _config_dict(weights: AdapterWeights) -> dict:
    """The config as ``adapter_config.json`` text holds it; rebuilt from the fields for hand-made configs, with their
    modules as the targets (read back, PEFT's selection then keeps exactly those)."""
    config = weights.config
    if config.raw:
        return config.raw
    return {
        "peft_type": "LORA",
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "use_rslora": config.use_rslora,
        "rank_pattern": config.rank_pattern,
        "alpha_pattern": config.alpha_pattern,
        "base_model_name_or_path": config.base_model_name_or_path,
        "alora_invocation_tokens": list(config.alora_invocation_tokens) if config.alora_invocation_tokens else None,
        "target_modules": sorted(weights.modules),
    }
