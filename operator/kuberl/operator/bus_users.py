"""Users on a shared external NATS (spec.bus.external.accountSigningKeySecret), minted by the operator.

Each experiment gets a trainer and a rollout user of the account, allowed only its own subjects, streams
and inbox (builders.bus_auth.shared_permissions), kept in the Secret `{exp}-bus-users` and minted once:
a later reconcile finds them there. The operator reads progress through one user of its own per account
(bus_auth.operator_permissions), minted once per process, so every experiment on one NATS shares one
connection. The signing key is read from the user's Secret by the operator only; no pod mounts it.
"""

from __future__ import annotations

import hashlib

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator import naming, nats_jwt
from kuberl.operator.builders import bus_auth
from kuberl.operator.context import kube
from kuberl.operator.progress import NatsCreds
from kuberl.operator.rules import decode_secret_value

FIELD = "spec.bus.external.accountSigningKeySecret"
_operator_users: dict[str, NatsCreds] = {}  # sha256 of (seed, account) -> the operator's own user


class BusUsersError(ValueError):
    """The signing key cannot mint users: the message names the field and Secret, never the seed."""


def minting(exp: RLExperiment) -> bool:
    ext = exp.spec.bus.external
    return ext is not None and ext.account_signing_key_secret is not None


async def signing_key(exp: RLExperiment) -> str | None:
    """The account signing key seed from the user's Secret, or None while it (or its key) is missing
    (observed.referenced_secrets reports that as a blocking problem)."""
    ref = exp.spec.bus.external.account_signing_key_secret  # type: ignore[union-attr]
    return decode_secret_value(await kube().get("Secret", exp.namespace, ref.name), ref.key)


def mint(exp: RLExperiment, seed: str) -> dict[str, str]:
    """A new trainer and rollout user for this experiment: role -> .creds file text."""
    ext = exp.spec.bus.external
    ref = ext.account_signing_key_secret  # type: ignore[union-attr]
    objects = bus_auth.bus_objects(exp)
    try:
        return {role: nats_jwt.mint_user_creds(seed, ext.account, f"{exp.namespace}/{exp.name}/{role}",  # type: ignore[union-attr]
                                               bus_auth.shared_permissions(role, objects))
                for role in (bus_auth.TRAINER, bus_auth.ROLLOUT)}
    except nats_jwt.NatsKeyError as exc:
        raise BusUsersError(f"{FIELD}: Secret {ref.name!r} key {ref.key!r}: {exc}") from None


async def users_for_children(exp: RLExperiment) -> dict[str, str] | None:
    """The experiment's users: those already in its users Secret, else new ones (minted once). None when
    this experiment does not mint users or its signing key Secret is missing. Raises BusUsersError."""
    if not minting(exp):
        return None
    secret = await kube().get("Secret", exp.namespace, naming.bus_users_secret_name(exp))
    kept = {role: decode_secret_value(secret, bus_auth.creds_key(role)) for role in (bus_auth.TRAINER, bus_auth.ROLLOUT)}
    if all(kept.values()):
        return kept  # type: ignore[return-value]
    seed = await signing_key(exp)
    return None if seed is None else mint(exp, seed)


def operator_user(exp: RLExperiment, seed: str) -> NatsCreds:
    """The operator's own user of this experiment's account (one per account and process)."""
    account = exp.spec.bus.external.account or ""  # type: ignore[union-attr]
    key = hashlib.sha256(f"{seed}\0{account}".encode()).hexdigest()
    if key not in _operator_users:
        ref = exp.spec.bus.external.account_signing_key_secret  # type: ignore[union-attr]
        try:
            text = nats_jwt.mint_user_creds(seed, account or None, "kuberl-operator", bus_auth.operator_permissions())
        except nats_jwt.NatsKeyError as exc:
            raise BusUsersError(f"{FIELD}: Secret {ref.name!r} key {ref.key!r}: {exc}") from None
        _operator_users[key] = NatsCreds(text, bus_auth.OPERATOR_INBOX)
    return _operator_users[key]
