"""The trajectory bus (NATS JetStream): the only coupling between trainer, rollout agents and operator.

`Bus` (client.py) is what the trainer and the agents use; `messages` holds the wire formats;
`server.start_nats_server` runs a local nats-server (`kuberl run`, tests, `kuberl bus` in a pod).
Names resolve lazily, so `kuberl.runtime.bus.messages` imports without loading nats-py.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Bus": "client", "BusError": "client", "BusFullError": "client", "GroupTooLargeError": "client", "Lease": "client",
    "MessageError": "messages", "Sample": "messages", "Ticket": "messages", "TrajectoryGroup": "messages",
    "BusNames": "names",
    "NatsServer": "server", "NatsServerError": "server", "start_nats_server": "server",
}
__all__ = [
    "Bus", "BusError", "BusFullError", "BusNames", "GroupTooLargeError", "Lease", "MessageError", "NatsServer", "NatsServerError",
    "Sample", "Ticket", "TrajectoryGroup", "start_nats_server",
]

if TYPE_CHECKING:
    from kuberl.runtime.bus.client import (
        Bus,
        BusError,
        BusFullError,
        GroupTooLargeError,
        Lease,
    )
    from kuberl.runtime.bus.messages import (
        MessageError,
        Sample,
        Ticket,
        TrajectoryGroup,
    )
    from kuberl.runtime.bus.names import BusNames
    from kuberl.runtime.bus.server import NatsServer, NatsServerError, start_nats_server


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
