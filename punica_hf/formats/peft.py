"""Reading PEFT LoRA adapters from disk or the Hugging Face Hub into ``AdapterWeights``.

A source is a local PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors`` or legacy
``adapter_model.bin``) or a Hub repo id resolved through ``huggingface_hub`` (its cache and ``HF_HUB_OFFLINE``
apply; an unreachable Hub fails at once rather than after retries). Checkpoints are data: pickled
``.bin`` files are read with ``weights_only=True`` and nothing from a checkpoint is ever executed. Nothing here
touches a model: the adapter store validates the result against the base model and only then writes it into the
layers.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .config import LoraAdapterConfig
from .weights import AdapterWeights, ModuleLora

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"

# base_model.model.<module>.lora_A.weight (an adapter name may sit before ".weight" in old checkpoints), lora_B's
# bias (lora_bias=True), DoRA's magnitude, and the bias of the targeted base layer (bias="lora_only" / "all"); an
# embedding's factors are parameters: <module>.lora_embedding_A [r, vocab] and lora_embedding_B [dim, r], the
# factors of a linear layer on one-hot token ids, read as lora_A / lora_B.
_LORA_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.(?:(?P<factor>lora_A|lora_B)(?:\.[^.]+)?\.(?P<param>weight|bias)"
    r"|lora_embedding_(?P<embedding_kind>[AB])(?:\.[^.]+)?"
    r"|lora_magnitude_vector(?:\.[^.]+)?(?:\.weight)?|base_layer\.bias)$"
)
# A bias="all" checkpoint's biases of modules without LoRA
_OTHER_BIAS_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.bias$")
_UNSUPPORTED_KEYS = (
    ("modules_to_save", "modules_to_save"),
)
# PEFT saves a module's full weight beside its LoRA when it targets embeddings or lm_head (they may be resized) and
# loads it over the base model's weight: kept in ``AdapterWeights.base_weights``, the model checks they are equal.
_BASE_COPY_SUFFIX = ".base_layer.weight"


def load_peft_adapter(
    source: str | Path,
    *,
    revision: str | None = None,
    subfolder: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | Path | None = None,
) -> AdapterWeights:
    """Read a LoRA adapter from a local PEFT folder or a Hub repo id."""
    config_path, weights_path = resolve_adapter_files(
        source, revision=revision, subfolder=subfolder, token=token, cache_dir=cache_dir
    )
    config = LoraAdapterConfig.from_file(config_path)
    state_dict = read_state_dict(weights_path)
    return adapter_weights_from_peft(state_dict, config, source=str(source))


def resolve_adapter_files(
    source: str | Path,
    *,
    revision: str | None = None,
    subfolder: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | Path | None = None,
) -> tuple[Path, Path]:
    """``(adapter_config.json, weights file)`` of a local PEFT folder or a Hub repo (downloaded or cached).

    A source that is not an existing local folder is looked up on the Hub only when it is a valid repo id
    (``name`` or ``org/name``); a ``Path`` never is.
    """
    local = Path(source).expanduser()
    if subfolder:
        local = local / subfolder
    if local.is_dir():
        config_path = local / CONFIG_NAME
        if not config_path.is_file():
            raise FileNotFoundError(f"{local} has no {CONFIG_NAME}: not a PEFT adapter folder")
        for name in (SAFETENSORS_NAME, PICKLE_NAME):
            if (local / name).is_file():
                return config_path, local / name
        raise FileNotFoundError(f"{local} has neither {SAFETENSORS_NAME} nor {PICKLE_NAME}")
    if local.exists():
        raise FileNotFoundError(f"{local} is a file, not a PEFT adapter folder (give the folder that holds it)")
    if isinstance(source, Path) or not _is_hub_repo_id(source):
        raise FileNotFoundError(f"no adapter folder at {local}; not a Hub repo id either")
    return _download_from_hub(
        source, revision=revision, subfolder=subfolder, token=token, cache_dir=cache_dir, local=local
    )


def _is_hub_repo_id(source: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(source)
    except HFValidationError:
        return False
    return True


def _download_from_hub(repo_id: str, *, revision, subfolder, token, cache_dir, local: Path) -> tuple[Path, Path]:
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError

    def cached(filename: str):
        """The cached file's path, a marker that the file is known not to exist, or None (nothing known)."""
        path_in_repo = f"{subfolder}/{filename}" if subfolder else filename
        return try_to_load_from_cache(repo_id, path_in_repo, cache_dir=cache_dir, revision=revision)

    def fetch(filename: str) -> Path:
        if cached(filename) is None and not constants.HF_HUB_OFFLINE:
            # With nothing cached, hf_hub_download retries a failed request for about 23 s (huggingface_hub 2.x).
            # One request without retries first makes an unreachable Hub or a missing repo fail at once.
            url = hf_hub_url(repo_id, filename, subfolder=subfolder, revision=revision)
            get_hf_file_metadata(url, token=token, timeout=constants.HF_HUB_ETAG_TIMEOUT)
        return Path(
            hf_hub_download(
                repo_id, filename, subfolder=subfolder, revision=revision, token=token, cache_dir=cache_dir
            )
        )

    try:
        config_path = fetch(CONFIG_NAME)
    except Exception as error:  # offline and not cached, unknown repo, no access, network error
        hub_said = (
            "HF_HUB_OFFLINE is set and the Hugging Face cache has no copy of it"
            if constants.HF_HUB_OFFLINE
            else f"{type(error).__name__}: {error}"
        )
        raise FileNotFoundError(
            f"no local folder ./{local.as_posix()}, and getting {CONFIG_NAME} of Hub repo {repo_id!r} failed: "
            f"{hub_said}"
        ) from error
    # A weights file in the cache first: with the Hub unreachable, asking for the other one would fail.
    for name in sorted((SAFETENSORS_NAME, PICKLE_NAME), key=lambda name: not isinstance(cached(name), str)):
        try:
            return config_path, fetch(name)
        except EntryNotFoundError:
            continue
        except Exception as error:
            raise OSError(f"could not get {name} of Hub repo {repo_id!r}: {error}") from error
    raise FileNotFoundError(f"Hub repo {repo_id!r} has neither {SAFETENSORS_NAME} nor {PICKLE_NAME}")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors or (weights-only) pickle file, on the CPU."""
    try:
        if path.suffix == ".safetensors":
            return load_file(path, device="cpu")
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, RuntimeError, EOFError, ValueError) as error:
        raise ValueError(f"could not read adapter weights {path}: {error}") from error
    except Exception as error:  # pickle errors, refused globals under weights_only
        raise ValueError(f"could not read adapter weights {path}: {type(error).__name__}: {error}") from error
    if not isinstance(state_dict, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state_dict.items()
    ):
        raise ValueError(f"adapter weights {path} are not a flat dict of tensors by name")
    for key, tensor in state_dict.items():
        if tensor.layout != torch.strided:  # PEFT saves dense tensors; a sparse one would fail later, unnamed
            raise ValueError(f"adapter weights {path}: tensor {key!r} is {tensor.layout}, not a dense tensor")
    return state_dict


def adapter_weights_from_peft(
    state_dict: dict[str, torch.Tensor], config: LoraAdapterConfig, *, source: str
) -> AdapterWeights:
    """Group a PEFT state dict by module, check ranks against the config and fold each module's scaling into B."""
    for marker, feature in _UNSUPPORTED_KEYS:
        key = next((key for key in state_dict if marker in key), None)
        if key is not None:
            raise ValueError(f"{feature} is not supported by punica_hf yet (found tensor {key!r} in {source})")
    factors: dict[str, dict[str, torch.Tensor]] = {}
    base_copies, biases = {}, {}
    factor_keys: dict[tuple[str, str], str] = {}  # (module, kind) -> the key it was read from
    for key, tensor in state_dict.items():
        if not tensor.is_floating_point():  # PEFT saves floats only: another dtype is a corrupt or hand-made file
            raise ValueError(f"adapter {source}: tensor {key!r} holds {tensor.dtype}, not floating-point values")
        match = _LORA_KEY.match(key)
        if match is not None:
            module, kind = match["module"], _tensor_kind(match)
            first = factor_keys.setdefault((module, kind), key)
            if first != key:  # with and without the "base_model.model." prefix: which one PEFT takes is unsure
                raise ValueError(f"adapter {source} holds the same tensor twice: {first!r} and {key!r}")
            factors.setdefault(module, {})[kind] = tensor
        elif key.endswith(_BASE_COPY_SUFFIX):
            base_copies[key.removeprefix("base_model.model.").removesuffix(_BASE_COPY_SUFFIX)] = tensor
        elif (bias_match := _OTHER_BIAS_KEY.match(key)) is not None:
            biases[bias_match["module"]] = tensor.float()
        else:
            raise ValueError(f"unexpected tensor {key!r} in adapter {source}: not a LoRA A/B weight")
    for module in base_copies:
        if module not in factors:  # a copy beside a module's own LoRA is that module's (possibly resized) weight
            raise ValueError(
                f"full copies of base layers (modules_to_save / trainable tokens) are not supported by punica_hf "
                f"yet (found tensor {module + _BASE_COPY_SUFFIX!r} in {source})"
            )
    if not factors:
        raise ValueError(f"adapter {source} holds no LoRA weights")

    modules, parameters = {}, {}
    target_parameters = config.raw.get("target_parameters") or []
    for name, pair in factors.items():
        if not {"lora_A", "lora_B"} <= set(pair):
            missing = ({"lora_A", "lora_B"} - set(pair)).pop()
            raise ValueError(f"adapter {source}: module {name} has no {missing} weight")
        if "lora_A.bias" in pair:
            raise ValueError(f"adapter {source}: module {name} has a lora_A bias, which PEFT never makes")
        lora_a, lora_b = pair["lora_A"], pair["lora_B"]
        if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_a.shape[0] != lora_b.shape[1]:
            raise ValueError(
                f"adapter {source}: module {name} has lora_A {tuple(lora_a.shape)} and lora_B "
                f"{tuple(lora_b.shape)}, expected [r, in] and [out, r]"
            )
        if _wraps_target_parameter(name, target_parameters):
            # Ranks, scaling and experts are resolved against the base model (matching.weights_for_model).
            parameters[name] = ModuleLora(lora_a=lora_a.float().contiguous(), lora_b=lora_b.float().contiguous())
            continue
        rank = config.rank_for(name)
        if lora_a.shape[0] != rank:
            raise ValueError(
                f"adapter {source}: module {name} has rank {lora_a.shape[0]} but its config gives r={rank}"
            )
        _check_vectors_against_config(name, pair, config, source)
        scaling = config.scaling_for(name)
        vectors = {kind: pair[kind].float() for kind in ("magnitude", "lora_bias", "base_bias") if kind in pair}
        if "lora_bias" in vectors:
            vectors["lora_bias"] = vectors["lora_bias"] * scaling
        try:
            modules[name] = ModuleLora(
                lora_a=lora_a.float().contiguous(), lora_b=(lora_b.float() * scaling).contiguous(), **vectors
            )
        except ValueError as error:
            raise ValueError(f"adapter {source}: module {name}: {error}") from None
    return AdapterWeights(modules=modules, config=config, source=source, base_weights=base_copies,
                          other_biases=biases, parameters=parameters)


def _check_vectors_against_config(module: str, tensors: dict[str, torch.Tensor], config: LoraAdapterConfig,
                                  source: str) -> None:
    """A module's DoRA magnitude and lora_B bias must be there exactly when the config asks for them: PEFT builds
    its layers from the config, ignores a tensor its layer lacks, and starts one the checkpoint lacks from its own
    initialisation (a DoRA magnitude from the base weight's norm), so the checkpoint alone would serve other math."""
    for kind, setting, tensor in (("magnitude", "use_dora", "lora_magnitude_vector"),
                                  ("lora_bias", "lora_bias", "lora_B bias")):
        asked = bool(config.raw.get(setting))
        if asked != (kind in tensors):
            has = "has no" if asked else "has a"
            raise ValueError(f"adapter {source}: module {module} {has} {tensor} but its config sets {setting}={asked}")


def _tensor_kind(match: re.Match) -> str:
    """What a ``_LORA_KEY`` match holds: lora_A, lora_B (weights; an embedding's too), lora_bias, lora_A.bias,
    magnitude or base_bias."""
    if match["embedding_kind"] is not None:
        return f"lora_{match['embedding_kind']}"
    factor = match["factor"]
    if factor is None:
        return "magnitude" if "lora_magnitude_vector" in match[0] else "base_bias"
    if match["param"] == "bias":
        return "lora_bias" if factor == "lora_B" else "lora_A.bias"
    return factor


def _wraps_target_parameter(module_key: str, target_parameters: list[str]) -> bool:
    """Whether PEFT's ``module_key`` names a wrapper of a targeted parameter: the module that holds it, with one
    ``.base_layer`` per wrapper nested around it (PEFT nests one wrapper per parameter of a module)."""
    module = module_key.replace(".base_layer", "")
    holders = {target.rpartition(".")[0] for target in target_parameters}
    return any(module == holder or module.endswith("." + holder) for holder in holders)
