"""punica_hf: many LoRA adapters in one batch on one Hugging Face base model.

The top-level names are imported on first use, so ``import punica_hf.ops`` or ``punica_hf.formats`` does not pull
in the model wrapper (and transformers) with them.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "MultiLoraModel": "punica_hf.model",
    "AdapterWeights": "punica_hf.formats",
    "load_adapter_weights": "punica_hf.formats",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'punica_hf' has no attribute {name!r}")
