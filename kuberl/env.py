"""Settings read from the environment, shared by the operator and the runtime roles."""

from __future__ import annotations

import os


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment; a bad value names the variable and the value."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be > 0 seconds")
    return value
