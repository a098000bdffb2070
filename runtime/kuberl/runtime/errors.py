"""Configuration errors of the roles: the exit code and termination message of docs/design/contracts.md.

A configuration error is a spec that cannot run (an unsupported trainer.backend, a model path that is
not on the volume, a data set row without the prompt field...): running the role again cannot fix it,
so the operator and `kuberl run` must not retry it. Every role entry point (`kuberl trainer`,
`kuberl rollout`, `kuberl engine`) therefore ends such a run with exit code 2 (CONFIG_ERROR_EXIT) and
a one-line reason in the container's termination message file; a runtime failure keeps exit code 1.

    with spec_errors():           # ValueError / FileNotFoundError from set-up -> ConfigError
        model_dir = resolve_model(spec.model, workdir)
    ...
    except ConfigError as exc:
        return config_error_exit("trainer", exc)   # stderr + termination message, returns 2
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager

# The exit code of a role that found a configuration error (the trainer Job's podFailurePolicy
# fails the Job on it; the operator and `kuberl run` do not restart it). 1 stays "failed, retryable".
CONFIG_ERROR_EXIT = 2
# Where Kubernetes reads a container's termination message (terminationMessagePath's default);
# $KUBERL_TERMINATION_LOG points it elsewhere (tests, `kuberl run`).
TERMINATION_LOG_ENV = "KUBERL_TERMINATION_LOG"
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
# The kubelet keeps at most 4096 bytes of a termination message; events keep 1024 characters.
MAX_MESSAGE_BYTES = 4000

# Environment variables whose values must never reach a message (tokens, passwords, keys).
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_KEY|ACCESS_KEY|PRIVATE_KEY", re.IGNORECASE)
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")
# Exception classes (by name, so that no HTTP library must be imported) that mean "try again later".
_TRANSIENT_NAMES = frozenset({"LocalEntryNotFoundError", "ConnectionError", "Timeout", "TimeoutError", "TransportError",
                              "TimeoutException", "ConnectError", "NetworkError"})


class ConfigError(ValueError):
    """The spec cannot run; the message names the field and the value (never a secret)."""


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then what caused it (__cause__, else __context__), and so on; each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is a network or server problem that a later attempt may not
    hit: the hub unreachable, a timeout, an HTTP 5xx or 429."""
    for current in exception_chain(exc):
        if isinstance(current, (ConnectionError, TimeoutError)) or _TRANSIENT_NAMES & {c.__name__ for c in type(current).__mro__}:
            return True
        status = getattr(getattr(current, "response", None), "status_code", None)
        if isinstance(status, int) and (status >= 500 or status == 429):
            return True
    return False


@contextmanager
def spec_errors() -> Iterator[None]:
    """Turn a ValueError or FileNotFoundError raised while setting up from the spec into a ConfigError
    (unless it comes from a network or server problem, which stays retryable)."""
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, FileNotFoundError) as exc:
        if is_transient(exc):
            raise
        raise ConfigError(str(exc)) from exc


def redact(message: str) -> str:
    """`message` on one line, without secret values from the environment or credentials in URLs,
    short enough for a termination message."""
    for name, value in os.environ.items():
        if value and len(value) >= 8 and _SECRET_NAME.search(name):  # short values are flags, not secrets
            message = message.replace(value, "***")
    message = _URL_USERINFO.sub(r"\g<scheme>***@", message)
    message = "; ".join(line.strip() for line in message.splitlines() if line.strip())
    data = message.encode()
    if len(data) > MAX_MESSAGE_BYTES:
        message = data[: MAX_MESSAGE_BYTES - 3].decode(errors="ignore") + "..."
    return message


def termination_log_path() -> str | None:
    """$KUBERL_TERMINATION_LOG, else /dev/termination-log when it exists (the kubelet creates it in a
    container; outside one nothing is written, not even as root)."""
    path = os.environ.get(TERMINATION_LOG_ENV)
    if path:
        return path
    return DEFAULT_TERMINATION_LOG if os.path.exists(DEFAULT_TERMINATION_LOG) else None


def write_termination_message(message: str) -> str | None:
    """Write the (redacted, one-line) message where Kubernetes reads it; returns the path, or None."""
    path = termination_log_path()
    if path is None:
        return None
    try:
        with open(path, "w") as fh:
            fh.write(redact(message) + "\n")
    except OSError as exc:  # the reason is on stderr anyway
        print(f"could not write the termination message to {path}: {exc}", file=sys.stderr)
        return None
    return path


def config_error_exit(role: str, exc: BaseException) -> int:
    """Report a configuration error of `role` on stderr and in the termination message; returns 2."""
    message = redact(str(exc) or type(exc).__name__)
    print(f"kuberl {role}: configuration error: {message}", file=sys.stderr, flush=True)
    write_termination_message(message)
    return CONFIG_ERROR_EXIT
