"""Serving many concurrent requests: the continuous-batching engine (engine.py) and its requests.

The names are imported on first use, so that gptoss-serve checks its flags and takes its signals
before JAX starts (it needs `EngineConfig` for its flags' defaults).
"""

from __future__ import annotations

import importlib

_EXPORTS = {"Engine": "engine", "EngineConfig": "config", "QueueFull": "request",
            "Request": "request", "Settings": "request", "TokenLogprob": "request"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
