"""Adapter files: reading PEFT folders, Hub repos and converted files, and writing converted files.

Every source is read into ``AdapterWeights`` (per-module factors, scaling folded in); nothing here touches a
model. ``load_adapter_weights`` picks the reader from the source: a ``.safetensors`` path is a converted file,
anything else a PEFT folder or Hub repo id.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .config import LoraAdapterConfig
from .converted import DTYPES, FORMAT, SUFFIX, load_converted, save_converted
from .matching import ModelModules, expert_entry, select_modules, weights_for_model
from .peft import load_peft_adapter
from .weights import AdapterWeights, ModuleLora

__all__ = [
    "AdapterWeights", "ModuleLora", "LoraAdapterConfig", "load_adapter_weights", "convert_adapter", "adapter_name",
    "load_converted", "save_converted", "DTYPES", "FORMAT", "SUFFIX", "ModelModules", "expert_entry", "select_modules",
    "weights_for_model",
]


def load_adapter_weights(
    source: str | Path,
    *,
    revision: str | None = None,
    subfolder: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | Path | None = None,
) -> AdapterWeights:
    """Read a LoRA adapter from a local PEFT folder, a Hub repo id or a converted ``.safetensors`` file."""
    local = Path(source).expanduser()
    if local.suffix == SUFFIX:
        if not local.is_file():
            raise FileNotFoundError(f"no converted adapter file at {local}")
        return load_converted(local)
    return load_peft_adapter(source, revision=revision, subfolder=subfolder, token=token, cache_dir=cache_dir)


def convert_adapter(
    source: str | Path,
    destination: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    base_model: str | None = None,
    overwrite: bool = False,
    **hub_kwargs,
) -> Path:
    """Convert a PEFT adapter (local folder, Hub repo id or converted file) into one converted file.

    ``destination`` is the file when it ends in ``.safetensors``, else a folder that receives
    ``<source name>.safetensors``; an existing file is refused unless ``overwrite``. ``hub_kwargs`` (``revision``,
    ``subfolder``, ``token``, ``cache_dir``) go to ``load_adapter_weights``. Returns the path written.
    """
    destination = Path(destination)
    if destination.suffix != SUFFIX:
        destination = destination / f"{adapter_name(source)}{SUFFIX}"
    weights = load_adapter_weights(source, **hub_kwargs)
    return save_converted(weights, destination, base_model=base_model, dtype=dtype, overwrite=overwrite)


def adapter_name(source: str | Path) -> str:
    """The name a source's converted file gets in a folder: its folder name, Hub repo name or file stem."""
    path = Path(str(source).rstrip("/\\"))
    if path.name in ("", ".", ".."):  # "." or "../": the folder's own name
        path = Path(source).resolve()
    name = path.stem if path.suffix == SUFFIX else path.name
    if not name or name.startswith("."):  # "/", or a hidden file no loader would take for an adapter file
        raise ValueError(f"no file name can be made from the source {str(source)!r}: give DST as a file "
                         f"ending in {SUFFIX}")
    return name
