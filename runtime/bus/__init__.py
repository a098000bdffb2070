"""The trajectory bus (NATS JetStream): the only coupling between trainer, rollout agents and operator.

`Bus` (client.py) is what the trainer and the agents use; `messages` holds the wire formats;
`server.start_nats_server` runs a local nats-server (`kuberl run`, tests, `kuberl bus` in a pod).
"""

from kuberl.runtime.bus.client import Bus, BusError, GroupTooLargeError, Lease
from kuberl.runtime.bus.messages import MessageError, Sample, Ticket, TrajectoryGroup
from kuberl.runtime.bus.names import BusNames
from kuberl.runtime.bus.server import NatsServer, NatsServerError, start_nats_server

__all__ = [
    "Bus", "BusError", "BusNames", "GroupTooLargeError", "Lease", "MessageError", "NatsServer", "NatsServerError",
    "Sample", "Ticket", "TrajectoryGroup", "start_nats_server",
]
