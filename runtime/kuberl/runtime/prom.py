"""Prometheus metrics of the trainer (rank 0) and the rollout agents (issue 15, observability 4).

Trainer: `TrainerMetrics.observe(step, row)` sets its gauges from each step's metrics.jsonl row (called by
`Tracking.log`, so every row the trainer reports, evaluation rounds included); `serve_trainer_metrics()`
serves them on $KUBERL_METRICS_PORT (set by the trainer Job; `kuberl run` leaves it unset and serves none).
Agent: `AgentCollector` reads a RolloutAgent's counters at scrape time, served as GET /metrics on the
agent's probe port (rollout/health.py). Both use registries of their own (not prometheus_client's global
one), so the process's other libraries add nothing to them.

The names below are the contract the chart's Grafana dashboard (charts/kuberl/dashboards/) queries;
tests/unit/test_prom.py checks every query of the dashboard against them.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("kuberl.prom")

METRICS_PORT_ENV = "KUBERL_METRICS_PORT"
WEIGHT_SYNC_STAGE = "train.publish_weights"  # the stage of a step that saves and announces the new weights

# metrics.jsonl key -> (gauge name, help). A row that lacks a key leaves its gauge as it was.
TRAINER_GAUGES: dict[str, tuple[str, str]] = {
    "policy_version": ("kuberl_trainer_policy_version", "Policy version after the last step"),
    "reward_mean": ("kuberl_trainer_reward_mean", "Mean reward of the last step's batch"),
    "loss": ("kuberl_trainer_loss", "Loss of the last step"),
    "entropy": ("kuberl_trainer_entropy", "Policy entropy (token mean) of the last step"),
    "grad_norm": ("kuberl_trainer_grad_norm", "Gradient norm of the last step"),
    "approx_kl": ("kuberl_trainer_approx_kl", "Approximate KL to the behaviour policy, last step"),
    "clip_fraction": ("kuberl_trainer_clip_fraction", "Fraction of clipped ratios, last step"),
    "lr": ("kuberl_trainer_learning_rate", "Learning rate of the last step"),
    "samples_per_second": ("kuberl_trainer_samples_per_second", "Samples trained per second (mean over recent steps)"),
    "staleness_mean": ("kuberl_trainer_staleness_mean", "Mean policy-version lag of the last batch"),
    "staleness_max": ("kuberl_trainer_staleness_max", "Largest policy-version lag of the last batch"),
    "dropped_stale": ("kuberl_trainer_dropped_stale_groups", "Groups dropped as too stale (staleness.dropStaleGroups), this run"),
    "over_stale": ("kuberl_trainer_over_stale_groups", "Groups trained although older than v - maxHeadOffpolicyness, this run"),
    "failed_groups": ("kuberl_trainer_failed_groups", "Groups given up by the agents, this run"),
    "step_seconds": ("kuberl_trainer_step_seconds", "Wall time of the last step"),
}


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


class TrainerMetrics:
    """The trainer's gauges and counters, in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.step = Gauge("kuberl_trainer_step", "Training step last reported", registry=r)
        self.gauges = {key: Gauge(name, doc, registry=r) for key, (name, doc) in TRAINER_GAUGES.items()}
        self.tokens_per_second = Gauge("kuberl_trainer_tokens_per_second", "Loss tokens trained per second, last step", registry=r)
        self.wait_fraction = Gauge("kuberl_trainer_wait_fraction", "Fraction of the last step spent waiting for rollouts", registry=r)
        self.weight_sync = Gauge("kuberl_trainer_weight_sync_seconds", "Time the last step took to save and announce its weights", registry=r)
        self.stage = Gauge("kuberl_trainer_stage_seconds", "Time of each stage of the last step", ["stage"], registry=r)
        self.eval = Gauge("kuberl_trainer_eval", "Last held-out evaluation round (spec.evaluation), by eval/* key", ["metric"], registry=r)
        self.last_report = Gauge("kuberl_trainer_last_step_timestamp_seconds", "Unix time of the last step report", registry=r)
        self.steps = Counter("kuberl_trainer_steps", "Steps trained by this process", registry=r)
        self.samples = Counter("kuberl_trainer_samples", "Samples trained by this process", registry=r)
        self.tokens = Counter("kuberl_trainer_tokens", "Loss tokens trained by this process", registry=r)

    def observe(self, step: int, row: dict[str, Any]) -> None:
        """Set the metrics from one metrics.jsonl row (a step's, or the extra line of a late evaluation round)."""
        self.step.set(step)
        for key, gauge in self.gauges.items():
            value = _number(row.get(key))
            if value is not None:
                gauge.set(value)
        for key, value in row.items():
            if key.startswith("eval/") and (v := _number(value)) is not None:
                self.eval.labels(metric=key[len("eval/"):]).set(v)
        secs, tokens, samples = _number(row.get("step_seconds")), _number(row.get("tokens")), _number(row.get("samples"))
        if secs is None:  # no training step in this row (an evaluation line): nothing more to count
            return
        self.steps.inc()
        if samples is not None:
            self.samples.inc(samples)
        if tokens is not None:
            self.tokens.inc(tokens)
            self.tokens_per_second.set(tokens / secs if secs > 0 else 0.0)
        wait = _number(row.get("wait_seconds"))
        if wait is not None:
            self.wait_fraction.set(wait / max(secs, 1e-9))
        timings = row.get("timings") if isinstance(row.get("timings"), dict) else {}
        for stage, value in timings.items():
            if (v := _number(value)) is not None:
                self.stage.labels(stage=stage).set(v)
        if (v := _number(timings.get(WEIGHT_SYNC_STAGE))) is not None:
            self.weight_sync.set(v)
        self.last_report.set(_number(row.get("time")) or time.time())


def metrics_port() -> int | None:
    """$KUBERL_METRICS_PORT as a port number; None when unset or empty."""
    value = os.environ.get(METRICS_PORT_ENV, "").strip()
    if not value:
        return None
    try:
        port = int(value)
    except ValueError:
        raise ValueError(f"${METRICS_PORT_ENV} must be a port number, got {value!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"${METRICS_PORT_ENV} must be a port number (0-65535), got {port}")
    return port


def serve_trainer_metrics(metrics: TrainerMetrics, port: int, host: str = "0.0.0.0") -> Any:
    """Serve `metrics` on host:port/metrics from a daemon thread; returns the server (its .server_port, .shutdown())."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    log.info("Prometheus metrics on %s:%d/metrics", host, server.server_port)
    return server


# ----------------------------------------------------------------------------------------------
# Rollout agent: read at scrape time
# ----------------------------------------------------------------------------------------------

# AgentStats field -> (counter name without _total, help)
AGENT_COUNTERS: dict[str, tuple[str, str]] = {
    "published": ("kuberl_agent_groups_published", "Groups published to the trainer"),
    "rejected": ("kuberl_agent_groups_rejected", "Groups rejected by dynamic sampling (all rewards equal)"),
    "failed": ("kuberl_agent_episodes_failed", "Episodes that failed (given back for another try)"),
    "failed_groups": ("kuberl_agent_groups_failed", "Tickets given up after rollout.maxTicketAttempts"),
    "started_behind": ("kuberl_agent_tickets_started_behind", "Tickets started on weights older than their issued version"),
    "weight_updates": ("kuberl_agent_weight_updates", "Weight updates loaded into the engine"),
    "evaluated": ("kuberl_agent_eval_tickets", "Held-out evaluation tickets done"),
    "samples": ("kuberl_agent_samples", "Samples (episodes) in published groups"),
    "reward_timeouts": ("kuberl_agent_reward_timeouts", "Responses whose reward ran past workflow.rewardTimeoutSeconds (scored 0)"),
    "rewards_refused": ("kuberl_agent_rewards_refused", "Rewards that were not finite numbers (their groups rejected)"),
}


class AgentCollector(Collector):
    """Reads the rollout agent (and its engine) that `source()` returns at each scrape; nothing while it is None."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def describe(self) -> list:
        return []  # no fixed set: collect() decides (registering must not call collect before the agent exists)

    def collect(self) -> Iterator[Any]:
        agent = self.source()
        if agent is None:
            return
        stats = agent.stats
        for field, (name, doc) in AGENT_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(getattr(stats, field)))
        samples = stats.samples
        yield GaugeMetricFamily("kuberl_agent_reward_mean", "Mean reward of the samples published since the agent started",
                                value=stats.reward_sum / samples if samples else math.nan)
        episodes = getattr(agent, "_episodes", None)
        if episodes is not None:
            yield GaugeMetricFamily("kuberl_agent_episodes_in_flight", "Episodes running now", value=len(episodes))
        yield GaugeMetricFamily("kuberl_agent_concurrency", "Episodes the agent runs at once at most (rollout.concurrency)",
                                value=float(agent.concurrency))
        engine = agent.engine
        in_flight = getattr(engine, "_in_flight", None)
        if isinstance(in_flight, int):
            yield GaugeMetricFamily("kuberl_agent_engine_generations_in_flight", "Generate requests the engine is serving for this agent",
                                    value=in_flight)
        yield GaugeMetricFamily("kuberl_agent_engine_down", "1 while the agent waits for a lost engine to come back",
                                value=1.0 if agent.engine_down else 0.0)
        yield GaugeMetricFamily("kuberl_agent_policy_version", "Policy version of the weights in the engine", value=float(engine.version))
        yield GaugeMetricFamily("kuberl_agent_seconds_since_progress", "Seconds since the agent last made progress (liveness reads this)",
                                value=max(time.monotonic() - agent.last_progress, 0.0))


def agent_registry(source: Any) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(source))
    return registry
