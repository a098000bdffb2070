"""NATS decentralized auth: per-experiment, per-role users minted from an account signing key.

On a shared external NATS run in JWT mode (operator -> accounts -> users, what `nsc` sets up), an
administrator gives KubeRL an account signing key (`spec.bus.external.accountSigningKeySecret`); the
operator mints each role of each experiment its own user, with the subject permissions of
kuberl.operator.builders.bus_auth scoped to the experiment's run, and hands each pod its role's
credentials file only. A user JWT is a signed statement ("user U, issued by account A, may publish to
...") that the server verifies with the account's public key: nothing is registered on the server.

The JWT format is NATS's (github.com/nats-io/jwt v2): base64url(header).base64url(claims).base64url(
ed25519 signature by the issuer's nkey). Signing and key encoding use `nkeys`, the NATS project's own
Python library (nats-py's credentials auth needs it too); the claims are a few JSON fields, written here.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from typing import Any

import nkeys

HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
PREFIXES = {"operator": nkeys.PREFIX_BYTE_OPERATOR, "account": nkeys.PREFIX_BYTE_ACCOUNT, "user": nkeys.PREFIX_BYTE_USER}
# Claims with no limit (-1): connection counts and sizes are the account's business, not the user's.
UNLIMITED_USER = {"subs": -1, "data": -1, "payload": -1}
UNLIMITED_ACCOUNT = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True, "conn": -1,
                     "leaf": -1, "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}

JETSTREAM_LIMITS = ("mem_storage", "disk_storage", "streams", "consumer")


class NatsKeyError(ValueError):
    """A seed that is not an nkey seed of the kind needed (never shows the seed)."""


def new_seed(kind: str) -> bytes:
    """A fresh nkey seed (`SO...`, `SA...`, `SU...`) for an operator, account or user."""
    return nkeys.encode_seed(os.urandom(32), PREFIXES[kind])


def keypair(seed: bytes | str, kind: str, what: str = "seed") -> nkeys.KeyPair:
    """The key pair of a seed, checked to be of `kind` (operator / account / user)."""
    raw = seed.strip().encode() if isinstance(seed, str) else seed.strip()
    try:
        kp = nkeys.from_seed(bytearray(raw))
        public = kp.public_key.decode()
    except Exception:  # noqa: BLE001 - nkeys raises several types; none may carry the seed into a message
        raise NatsKeyError(f"{what} is not an nkey seed (expected one starting with S{public_letter(kind)})") from None
    if not public.startswith(public_letter(kind)):
        raise NatsKeyError(f"{what} is a {kind_of(public)} key, not an {kind} signing key (expected a seed starting with S{public_letter(kind)})")
    return kp


def public_letter(kind: str) -> str:
    return {"operator": "O", "account": "A", "user": "U"}[kind]


def kind_of(public: str) -> str:
    return {"O": "operator", "A": "account", "U": "user"}.get(public[:1], "unknown")


def _compact(obj: Any) -> bytes:
    """JSON without spaces: a JWT travels in the CONNECT line, which servers cap (max_control_line, 4 KiB by default)."""
    return json.dumps(obj, separators=(",", ":")).encode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def encode(signer: nkeys.KeyPair, subject: str, name: str, nats: dict[str, Any], *, expires: int | None = None) -> str:
    """A JWT for `subject` (a public nkey) signed by `signer`; `nats` holds the kind's claims (type, version...)."""
    claims: dict[str, Any] = {"iat": int(time.time()), "iss": signer.public_key.decode(), "name": name, "sub": subject, "nats": nats}
    if expires is not None:
        claims["exp"] = expires
    # jti: the hash of the claims without it, as the Go library computes it (a unique id, checked by nobody).
    claims["jti"] = base64.b32encode(hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()).decode().rstrip("=")
    signing_input = f"{_b64(_compact(HEADER))}.{_b64(_compact(claims))}"
    return f"{signing_input}.{_b64(signer.sign(signing_input.encode()))}"


def decode(token: str) -> dict[str, Any]:
    """The claims of a JWT (not verified: for tests and messages)."""
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def user_jwt(signing_key: nkeys.KeyPair, account: str, user_public: str, name: str, permissions: dict[str, Any]) -> str:
    """A user of `account` (its public key; `signing_key` is the account's key or one of its signing keys).

    `permissions` is in nats.conf form ({"publish": {"allow": [...]}, "subscribe": {"allow": [...]}});
    a JWT spells them `pub` / `sub`.
    """
    nats: dict[str, Any] = {"pub": dict(permissions.get("publish", {})), "sub": dict(permissions.get("subscribe", {})),
                            **UNLIMITED_USER, "type": "user", "version": 2}
    if signing_key.public_key.decode() != account:
        nats["issuer_account"] = account  # signed by one of the account's signing keys, not the account itself
    return encode(signing_key, user_public, name, nats)


def creds_file(jwt: str, seed: bytes) -> str:
    """The `.creds` file nats-py (`user_credentials=`), the nats CLI and every NATS client read."""
    return (f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n"
            "NKEYs are sensitive and should be treated as secrets.\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{seed.decode()}\n------END USER NKEY SEED------\n\n"
            "*************************************************************\n")


def mint_user_creds(signing_seed: bytes | str, account: str | None, name: str, permissions: dict[str, Any]) -> str:
    """A new user (fresh key pair) of the account, as a `.creds` file. `account`: the account's public key
    (needed when `signing_seed` is a signing key of it rather than the account's own key)."""
    signer = keypair(signing_seed, "account", "the account signing key")
    issuer_account = account or signer.public_key.decode()
    if kind_of(issuer_account) != "account":
        raise NatsKeyError(f"account {issuer_account[:8]}... is not an account public key (expected one starting with A)")
    seed = new_seed("user")
    user = nkeys.from_seed(bytearray(seed)).public_key.decode()
    return creds_file(user_jwt(signer, issuer_account, user, name, permissions), seed)


def account_jwt(operator: nkeys.KeyPair, account_public: str, name: str, signing_keys: list[str] | None = None, *,
                jetstream: bool = True) -> str:
    """An account with no limits, with JetStream or without (a system account) (for tests; production uses `nsc`)."""
    limits = UNLIMITED_ACCOUNT if jetstream else {k: v for k, v in UNLIMITED_ACCOUNT.items() if k not in JETSTREAM_LIMITS}
    nats = {"limits": limits, "signing_keys": signing_keys or [], "default_permissions": {"pub": {}, "sub": {}},
            "type": "account", "version": 2}
    return encode(operator, account_public, name, nats)


def operator_jwt(operator: nkeys.KeyPair, name: str) -> str:
    return encode(operator, operator.public_key.decode(), name, {"type": "operator", "version": 2})
