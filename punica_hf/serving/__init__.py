"""Serving: continuous batching with an adapter per request (``Engine``) and an OpenAI-compatible HTTP server.

The engine needs only torch and transformers; the server (``punica_hf.serving.app``, ``punica-hf serve``) needs
the ``serve`` extra (FastAPI, uvicorn, prometheus_client); its replicas on Ray Serve (``punica_hf.serving.ray``,
``punica-hf serve --replicas N``) the ``ray`` extra.
"""

from .engine import Engine
from .handles import RequestHandle
from .types import (
    Completion,
    Delta,
    EngineClosedError,
    EngineConfig,
    EngineStats,
    QueueFullError,
    SamplingParams,
    StepRecord,
)
from .text import DemoTokenizer, HFTokenizer, TextStream

__all__ = [
    "Completion",
    "Delta",
    "DemoTokenizer",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineStats",
    "HFTokenizer",
    "QueueFullError",
    "RequestHandle",
    "SamplingParams",
    "StepRecord",
    "TextStream",
]
