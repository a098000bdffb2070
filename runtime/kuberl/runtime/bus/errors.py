"""Errors of the bus client (kuberl.runtime.bus): raised by Bus methods, caught by the trainer and agents."""

from __future__ import annotations


class BusError(RuntimeError):
    """The bus cannot do what was asked (unreachable, no JetStream, missing objects, too large...)."""


class GroupTooLargeError(BusError):
    """A trajectory group that can never fit the trajectory stream."""


class BusFullError(BusError):
    """A stream reached its size limit (the trainer is not keeping up): retry later or enlarge the bus."""
