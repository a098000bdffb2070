"""Users of the embedded bus: one NATS user per role with the subjects that role needs, nothing more.

Called by builders.bus (nats.conf and the credentials Secret), builders.common (each pod's env names
its role's key only) and kuberl.operator.lifecycle (the operator's own user). The embedded NATS server
serves one experiment, so the roles are:

- `trainer`: owns the bus. Creates, resets and deletes the experiment's streams, consumers, KV and
  object store, writes every KV key and the weights.
- `rollout` (agents): reads tickets, KV state and weights; publishes trajectory groups (and their
  chunks) and evaluation results; acks what it pulled. It may create the experiment's streams and
  consumers when it starts before the trainer (creating an existing stream with another configuration
  is refused by JetStream, so this never changes one), but it may not update, purge or delete a
  stream, delete messages or consumers of the work queues, write any KV key, or write or delete
  anything in the weights object store.
- `operator`: reads the KV bucket (progress) and the metrics stream (`kuberl plot`), and writes only
  the `control` key (checkpoint requests).

Passwords: HMAC-SHA256 of the experiment's random bus token (kept in the Secret under `token`, read
only by the operator) with the role name, so re-rendering the Secret gives the same passwords and a
pod holding one role's password cannot derive another's. The names re-derive the contract's
(docs/design/contracts.md, kuberl.runtime.bus.names): the operator never imports the runtime.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator import naming

TRAINER, ROLLOUT, OPERATOR = "trainer", "rollout", "operator"
ROLES = (TRAINER, ROLLOUT, OPERATOR)
TOKEN_KEY = "token"  # the random secret the passwords derive from; no pod mounts it
USER_ENV = "KUBERL_BUS_USER"
PASSWORD_ENV = "KUBERL_BUS_PASSWORD"
INBOX = "_INBOX.>"
# Durable consumers the agents pull from (kuberl.runtime.bus.names).
AGENTS_CONSUMER, EVAL_AGENTS_CONSUMER = "agents", "eval-agents"
# KV keys the operator writes (kuberl.operator.progress: checkpoint requests); it reads every key.
OPERATOR_KV_WRITES = ("control",)


def password_key(role: str) -> str:
    """The Secret key of a role's password: `trainer-password`, `rollout-password`, `operator-password`."""
    _check_role(role)
    return f"{role}-password"


def role_password(token: str, role: str) -> str:
    """The role's password, derived from the experiment's bus token (43 URL-safe characters)."""
    _check_role(role)
    if not token:
        raise ValueError("bus token must be a non-empty string")
    digest = hmac.new(token.encode(), f"kuberl-bus-user:{role}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"bus role {role!r} is unknown: use one of {', '.join(ROLES)}")


@dataclass(frozen=True)
class BusObjects:
    """The experiment's bus names as kuberl.runtime.bus.names.BusNames derives them (with its run)."""

    prefix: str  # subjects kuberl.<run>.<exp> (no run: kuberl.<exp>)
    tickets_stream: str
    traj_stream: str
    kv_bucket: str
    weights_bucket: str
    metrics_stream: str  # every step's metrics row (kuberl.runtime.bus.metrics; `kuberl plot` reads it)

    @property
    def kv_stream(self) -> str:
        return f"KV_{self.kv_bucket}"

    @property
    def weights_stream(self) -> str:
        return f"OBJ_{self.weights_bucket}"

    @property
    def streams(self) -> tuple[str, ...]:
        return (self.tickets_stream, self.traj_stream, self.kv_stream, self.weights_stream, self.metrics_stream)


def bus_objects(exp: RLExperiment) -> BusObjects:
    run = naming.bus_run(exp)
    e = exp.name.upper().replace("-", "_")
    if run:
        e += "_" + run.upper().replace("-", "_").replace(".", "_")
    return BusObjects(
        prefix=f"kuberl.{run}.{exp.name}" if run else f"kuberl.{exp.name}",
        tickets_stream=f"KUBERL_{e}_TICKETS",
        traj_stream=f"KUBERL_{e}_TRAJ",
        kv_bucket=f"kuberl_{e}",
        weights_bucket=f"kuberl_{e}_weights",
        metrics_stream=f"KUBERL_{e}_METRICS",
    )


def _lookup(stream: str) -> list[str]:
    """Look a stream and its consumers up; create them where missing (an existing stream or consumer
    with another configuration is refused by JetStream's create, never changed)."""
    api = "$JS.API"
    return [f"{api}.STREAM.INFO.{stream}", f"{api}.STREAM.CREATE.{stream}", f"{api}.CONSUMER.INFO.{stream}.>",
            f"{api}.CONSUMER.CREATE.{stream}", f"{api}.CONSUMER.CREATE.{stream}.>", f"{api}.CONSUMER.DURABLE.CREATE.{stream}.>"]


def _read(stream: str) -> list[str]:
    """Read a KV or object store stream: direct or API gets, and ordered consumers of one's own
    (KV watches, object downloads) with their flow control, removed when done."""
    api = "$JS.API"
    return [f"{api}.STREAM.MSG.GET.{stream}", f"{api}.DIRECT.GET.{stream}", f"{api}.DIRECT.GET.{stream}.>",
            f"{api}.CONSUMER.MSG.NEXT.{stream}.>", f"{api}.CONSUMER.DELETE.{stream}.>", f"$JS.ACK.{stream}.>", f"$JS.FC.{stream}.>"]


def _pull(stream: str, consumer: str) -> list[str]:
    """Pull from one durable consumer of a work queue and ack (or nak, extend, terminate) what came."""
    return [f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}", f"$JS.ACK.{stream}.{consumer}.>"]


def permissions(role: str, objects: BusObjects) -> dict[str, Any]:
    """NATS `permissions` of a role: publish and subscribe allow-lists (everything else is refused)."""
    _check_role(role)
    o = objects
    if role == TRAINER:
        # One experiment per embedded server: the trainer may do anything JetStream offers there.
        publish = ["$JS.API.>", "$JS.ACK.>", "$JS.FC.>", "$KV.>", "$O.>", f"{o.prefix}.>"]
    elif role == ROLLOUT:
        # STREAM.NAMES: nats-py finds the object store's stream by subject before a download.
        publish = ["$JS.API.INFO", "$JS.API.STREAM.NAMES", *(s for stream in o.streams for s in _lookup(stream)), *_read(o.kv_stream), *_read(o.weights_stream),
                   *_pull(o.tickets_stream, AGENTS_CONSUMER), *_pull(o.tickets_stream, EVAL_AGENTS_CONSUMER),
                   f"{o.prefix}.traj", f"{o.prefix}.traj.chunk", f"{o.prefix}.eval.results"]
    else:
        publish = ["$JS.API.INFO"]
        for stream in (o.kv_stream, o.metrics_stream):
            publish += [f"$JS.API.STREAM.INFO.{stream}", *_read(stream), f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>"]
        publish += [f"$KV.{o.kv_bucket}.{key}" for key in OPERATOR_KV_WRITES]
    return {"publish": {"allow": publish}, "subscribe": {"allow": [INBOX]}}


# --- a shared NATS (spec.bus.external with accountSigningKeySecret): users minted per experiment ---------
CREDS_ENV = "KUBERL_BUS_CREDS"  # the role's .creds file (user JWT and seed), from the users Secret
INBOX_ENV = "KUBERL_BUS_INBOX"  # the reply-subject prefix of this experiment's clients


def creds_key(role: str) -> str:
    """The key of a role's credentials file in the users Secret: `trainer.creds`, `rollout.creds`."""
    _check_role(role)
    return f"{role}.creds"


def inbox_prefix(objects: BusObjects) -> str:
    """The experiment's own reply subjects (`_INBOX_<bucket>.<id>`): on a shared server the default
    `_INBOX.>` would let every user subscribe to every other's replies (KV values, object chunks)."""
    return f"_INBOX_{objects.kv_bucket}"


def _own_stream(stream: str) -> list[str]:
    """Everything JetStream offers on one stream and its consumers, nothing on any other stream."""
    api = "$JS.API"
    return [f"{api}.STREAM.*.{stream}", f"{api}.STREAM.MSG.*.{stream}", f"{api}.CONSUMER.*.{stream}", f"{api}.CONSUMER.*.{stream}.>",
            f"{api}.CONSUMER.DURABLE.CREATE.{stream}.>", f"{api}.CONSUMER.MSG.NEXT.{stream}.>", f"{api}.DIRECT.GET.{stream}",
            f"{api}.DIRECT.GET.{stream}.>", f"$JS.ACK.{stream}.>", f"$JS.FC.{stream}.>"]


def shared_permissions(role: str, objects: BusObjects) -> dict[str, Any]:
    """Permissions of a role's user on a NATS that other experiments share (one account, many runs).

    Unlike the embedded bus's trainer (alone on its server, so `$JS.API.>`), every role here is
    confined to this experiment's streams, KV bucket, object store and subjects, and replies come on
    the experiment's own inbox prefix. `$JS.API.INFO` and `STREAM.NAMES` (nats-py's object-store
    lookup) show account totals and stream names, never another experiment's data.
    """
    _check_role(role)
    o = objects
    if role == TRAINER:
        publish = ["$JS.API.INFO", "$JS.API.STREAM.NAMES", *(s for stream in o.streams for s in _own_stream(stream)),
                   f"$KV.{o.kv_bucket}.>", f"$O.{o.weights_bucket}.>", f"{o.prefix}.>"]
        perms = {"publish": {"allow": publish}}
    elif role == ROLLOUT:
        perms = permissions(role, objects)
    else:
        raise ValueError("the operator's own user on a shared NATS is account-wide: see operator_permissions()")
    return {"publish": perms["publish"], "subscribe": {"allow": [f"{inbox_prefix(o)}.>"]}}


def operator_permissions() -> dict[str, Any]:
    """The operator's user on a shared account: reads every experiment's KV progress and metrics stream and
    writes only `control` keys (one connection per NATS URL, whatever the number of experiments).
    The operator holds the account signing key anyway; this user only keeps its connection to what it reads."""
    api = "$JS.API"
    publish = [f"{api}.INFO", f"{api}.STREAM.INFO.*", f"{api}.STREAM.MSG.GET.*", f"{api}.DIRECT.GET.*", f"{api}.DIRECT.GET.*.>",
               f"{api}.CONSUMER.CREATE.*", f"{api}.CONSUMER.CREATE.*.>", f"{api}.CONSUMER.MSG.NEXT.*.>", f"{api}.CONSUMER.DELETE.*.>",
               "$JS.FC.*.>", *(f"$KV.*.{key}" for key in OPERATOR_KV_WRITES)]
    return {"publish": {"allow": publish}, "subscribe": {"allow": [OPERATOR_INBOX + ".>"]}}


OPERATOR_INBOX = "_INBOX_kuberl_operator"
