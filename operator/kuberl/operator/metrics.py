"""Prometheus metrics of the operator (prometheus-client), served on --metrics-port by kuberl.operator.main.

The handlers call `record_*`; names are prefixed `kuberl_operator_`. Nothing secret goes into labels.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

REGISTRY = CollectorRegistry()
RECONCILES = Counter("kuberl_operator_reconciles", "Reconciliations run, by handler.", ["handler"], registry=REGISTRY)
ERRORS = Counter("kuberl_operator_errors", "Handler errors, by handler and kind of error.", ["handler", "kind"], registry=REGISTRY)
EXPERIMENTS = Gauge("kuberl_operator_experiments", "RLExperiments by phase.", ["phase"], registry=REGISTRY)
SCALE_DECISIONS = Counter("kuberl_operator_scale_decisions", "Autoscaler decisions that changed rollout replicas.",
                          ["direction"], registry=REGISTRY)
STATUS_WRITES = Counter("kuberl_operator_status_writes", "RLExperiment status patches written.", registry=REGISTRY)
PHASES = ("Pending", "Initializing", "Running", "Suspended", "Succeeded", "Failed")

_phase_of: dict[str, str] = {}


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Start the /metrics endpoint in a background thread (port 0 = off)."""
    if port:
        start_http_server(port, addr=addr, registry=REGISTRY)


def record_reconcile(handler: str) -> None:
    RECONCILES.labels(handler=handler).inc()


def record_error(handler: str, kind: str) -> None:
    ERRORS.labels(handler=handler, kind=kind).inc()


def record_phase(key: str, phase: str | None) -> None:
    """Track one experiment's phase (None: the experiment is gone) and move the per-phase gauge (O(1):
    called on every tick of every experiment)."""
    old = _phase_of.pop(key, None) if phase is None else _phase_of.get(key)
    if old == phase:
        return
    if phase is not None:
        _phase_of[key] = phase
        if phase in PHASES:
            EXPERIMENTS.labels(phase=phase).inc()
    if old in PHASES:
        EXPERIMENTS.labels(phase=old).dec()


def record_status_write() -> None:
    STATUS_WRITES.inc()


def record_scale(old: int, new: int) -> None:
    if new != old:
        SCALE_DECISIONS.labels(direction="up" if new > old else "down").inc()
