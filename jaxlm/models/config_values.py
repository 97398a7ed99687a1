"""Numbers read from an HF config, checked where they are read: a bad value (a string, NaN,
zero where the model divides by it) is a ValueError naming its field, not NaN logits or a
ZeroDivisionError deep inside model construction."""

from __future__ import annotations

import math
from typing import Any


def config_float(config: Any, key: str, default: float | None = None, *, positive: bool = False) -> float | None:
    """``config.key`` as a finite float (``> 0`` when ``positive``); None when unset and no default."""
    return check_float(key, getattr(config, key, default), positive=positive)


def check_float(name: str, value: Any, *, positive: bool = False) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"config {name}={value!r} is not a number")
    f = float(value)
    if not math.isfinite(f) or (positive and f <= 0):
        raise ValueError(f"config {name}={value!r}: must be a finite number{' > 0' if positive else ''}")
    return f
