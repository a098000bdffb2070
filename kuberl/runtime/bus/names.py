"""Names of an experiment's bus objects (streams, subjects, consumers, buckets, KV keys, headers).

Defined once here, exactly as docs/design/contracts.md states them; the Bus client and tests use them.
The operator cannot import the runtime, so it re-derives the same names from the contract.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

EXPERIMENT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

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

# Message headers of chunked trajectory groups (ours) and JetStream's dedupe id.
H_MSG_ID = "Nats-Msg-Id"
H_GROUP = "Kuberl-Group"
H_ATTEMPT = "Kuberl-Attempt"
H_CHUNK = "Kuberl-Chunk"
H_CHUNKS = "Kuberl-Chunks"
H_SIZE = "Kuberl-Size"


@dataclass(frozen=True)
class BusNames:
    """Every bus name of one experiment: `BusNames.for_experiment("my-exp")`."""

    experiment: str
    tickets_stream: str
    tickets_subject: str
    traj_stream: str
    traj_subject: str
    chunk_subject: str
    kv_bucket: str
    weights_bucket: str

    @classmethod
    def for_experiment(cls, experiment: str) -> BusNames:
        if not isinstance(experiment, str) or not EXPERIMENT_NAME.match(experiment) or len(experiment) > 63:
            raise ValueError(
                f"experiment name {experiment!r} is not a DNS-1123 label (lowercase letters, digits and '-', "
                "starting and ending alphanumeric, at most 63 characters)"
            )
        e = experiment.upper().replace("-", "_")
        return cls(
            experiment=experiment,
            tickets_stream=f"KUBERL_{e}_TICKETS",
            tickets_subject=f"kuberl.{experiment}.tickets",
            traj_stream=f"KUBERL_{e}_TRAJ",
            traj_subject=f"kuberl.{experiment}.traj",
            chunk_subject=f"kuberl.{experiment}.traj.chunk",
            kv_bucket=f"kuberl_{e}",
            weights_bucket=f"kuberl_{e}_weights",
        )
