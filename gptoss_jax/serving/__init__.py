"""Serving many concurrent requests: the continuous-batching engine (engine.py) and its requests."""

from .engine import Engine
from .request import QueueFull, Request, Settings

__all__ = ["Engine", "QueueFull", "Request", "Settings"]
