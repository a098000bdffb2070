"""The operator's process-wide settings and shared clients: CONFIG, the Kubernetes client, the clock, events.

Environment variables set OperatorConfig's knobs (tests shorten them, or replace CONFIG's kube/bus/cache).
Used by kuberl.operator.observe, .apply and .lifecycle (which re-exports these names for the handlers).
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass, field
from typing import Any

from kuberl.env import env_seconds
from kuberl.operator.kube import KubeClient
from kuberl.operator.progress import BusReader


def env_count(name: str, default: int) -> int:
    """A positive integer from the environment; anything else is a clear error at start-up."""
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{name} must be a positive integer, got {text!r}")
    return int(text)


@dataclass
class OperatorConfig:
    """Process-wide knobs (environment variables, so tests can shorten them)."""

    interval: float = field(default_factory=lambda: env_seconds("KUBERL_OPERATOR_INTERVAL", 5.0))  # monitor period
    checkpoint_timeout: float = field(default_factory=lambda: env_seconds("KUBERL_CHECKPOINT_TIMEOUT", 120.0))  # suspend waits
    retry_delay: float = field(default_factory=lambda: env_seconds("KUBERL_OPERATOR_RETRY", 15.0))  # recheck of a missing Secret/PVC
    node_cache_seconds: float = 60.0  # Node capacity changes slowly; do not list Nodes every tick
    # A status change that is only training progress is written at most this often per experiment
    # (phase, conditions, replicas and observedGeneration are written at once).
    status_interval: float = field(default_factory=lambda: env_seconds("KUBERL_STATUS_INTERVAL", 30.0))
    prerequisite_interval: float = 60.0  # the monitor re-reads the user's Secrets/PVCs this often (a reconcile always)
    token_cache_seconds: float = 300.0  # the bus token (Secret) is re-read this often
    max_reconciles: int = field(default_factory=lambda: env_count("KUBERL_OPERATOR_MAX_RECONCILES", 16))  # concurrent child applies
    kube: KubeClient | None = None
    bus: BusReader = field(default_factory=BusReader)
    nodes: tuple[float, list[dict[str, Any]]] | None = None
    cache: Any = None  # kuberl.operator.cache.Children once kopf's indexes are bound; None: read the API


CONFIG = OperatorConfig()


def kube() -> KubeClient:
    if CONFIG.kube is None:
        CONFIG.kube = KubeClient.from_environment()
    return CONFIG.kube


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


async def event(body: Any, type_: str, reason: str, message: str) -> None:
    await kube().emit_event(dict(body), type_, reason, message)
