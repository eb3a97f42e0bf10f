"""punica_hf: serve many LoRA adapters in one batch on one Hugging Face base model."""

from .loader import AdapterWeights, load_adapter_weights
from .model import MultiLoraModel

__all__ = ["MultiLoraModel", "AdapterWeights", "load_adapter_weights"]
__version__ = "0.1.0"
