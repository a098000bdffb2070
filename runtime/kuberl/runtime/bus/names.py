"""Names of an experiment's bus objects (streams, subjects, consumers, buckets, KV keys, headers).

Defined once here, exactly as docs/design/contracts.md states them; the Bus client and tests use them.
The operator cannot import the runtime, so it re-derives the same names from the contract.
On a cluster every name also carries the run (`<namespace>.<uid>`, $KUBERL_BUS_RUN set by the operator),
so experiments of the same name in two namespaces, or a re-created one, never share a bus object.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

EXPERIMENT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# The run: dot-separated DNS labels, `<namespace>.<first 12 hex of the uid>` as the operator sets it.
RUN_ENV = "KUBERL_BUS_RUN"
RUN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
RUN_MAX = 100

# KV keys (values are JSON objects; see the contract for their fields).
KEY_POLICY_VERSION = "policy_version"
KEY_WEIGHTS = "weights"
KEY_PROGRESS = "progress"
KEY_TICKETS = "tickets"
KEY_CONTROL = "control"
KV_KEY = re.compile(r"^[-/_=.a-zA-Z0-9]+$")

# Durable consumers.
AGENTS_CONSUMER = "agents"
TRAINER_CONSUMER = "trainer"
# Held-out evaluation (spec.evaluation): its tickets and results ride the tickets stream on subjects of
# their own, each read by its own durable consumer, so they never mix with training tickets or groups.
EVAL_AGENTS_CONSUMER = "eval-agents"
EVAL_TRAINER_CONSUMER = "eval-trainer"

# Message headers of chunked trajectory groups (ours) and JetStream's dedupe id.
H_MSG_ID = "Nats-Msg-Id"
H_GROUP = "Kuberl-Group"
H_ATTEMPT = "Kuberl-Attempt"
H_CHUNK = "Kuberl-Chunk"
H_CHUNKS = "Kuberl-Chunks"
H_SIZE = "Kuberl-Size"


@dataclass(frozen=True)
class BusNames:
    """Every bus name of one experiment: `BusNames.for_experiment("my-exp")`, or with its run
    `BusNames.for_experiment("my-exp", run="team-a.4f3a0c9e12ab")`."""

    experiment: str
    tickets_stream: str
    tickets_subject: str
    eval_tickets_subject: str
    eval_results_subject: str
    traj_stream: str
    traj_subject: str
    chunk_subject: str
    kv_bucket: str
    weights_bucket: str
    metrics_stream: str  # every step's metrics row (kuberl.runtime.bus.metrics)
    metrics_subject: str

    @classmethod
    def for_experiment(cls, experiment: str, run: str | None = None) -> BusNames:
        """Names of `experiment`'s objects; `run` None = $KUBERL_BUS_RUN (unset or "" = no run: the names
        of the contract without one, as `kuberl run` uses them on its own private bus).

        With a run R the subjects are `kuberl.{R}.{exp}.*` (a NATS user limited to `kuberl.{R}.>` sees
        only this run) and the streams and buckets carry R upper-cased ('.' and '-' -> '_') after E.
        """
        if not isinstance(experiment, str) or not EXPERIMENT_NAME.match(experiment) or len(experiment) > 63:
            raise ValueError(
                f"experiment name {experiment!r} is not a DNS-1123 label (lowercase letters, digits and '-', "
                "starting and ending alphanumeric, at most 63 characters)"
            )
        run = os.environ.get(RUN_ENV, "") if run is None else run
        if run and (not RUN.match(run) or len(run) > RUN_MAX):
            raise ValueError(f"bus run {run!r} ({RUN_ENV}) must be dot-separated DNS labels, at most {RUN_MAX} characters")
        e = experiment.upper().replace("-", "_")
        if run:
            e += "_" + run.upper().replace("-", "_").replace(".", "_")
        prefix = f"kuberl.{run}.{experiment}" if run else f"kuberl.{experiment}"
        return cls(
            experiment=experiment,
            tickets_stream=f"KUBERL_{e}_TICKETS",
            tickets_subject=f"{prefix}.tickets",
            eval_tickets_subject=f"{prefix}.eval.tickets",
            eval_results_subject=f"{prefix}.eval.results",
            traj_stream=f"KUBERL_{e}_TRAJ",
            traj_subject=f"{prefix}.traj",
            chunk_subject=f"{prefix}.traj.chunk",
            kv_bucket=f"kuberl_{e}",
            weights_bucket=f"kuberl_{e}_weights",
            metrics_stream=f"KUBERL_{e}_METRICS",
            metrics_subject=f"{prefix}.metrics",
        )
