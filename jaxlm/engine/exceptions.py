"""Exceptions the front end maps to HTTP answers: a leaf module, so the server imports no jax for them."""

from __future__ import annotations


class QueueFullError(ValueError):
    """The waiting queue is past max_num_queued_reqs (the server answers 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop died; no request can be served any more (the server answers 503)."""


class EngineGenerateError(RuntimeError):
    """One request failed inside the engine (vLLM's name); the engine goes on serving the
    others (the server answers 500 for that request alone)."""
