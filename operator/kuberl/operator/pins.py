"""The pins of an experiment in the cluster: written once, and a checkpoint before a trainer is re-created.

Called by kuberl.operator.lifecycle: `ensure_pins` before the children are built (the pure rules are
in kuberl.operator.builders.pinning), `checkpoint_before_recreate` before a running trainer Job whose
template changed (a spec edit or the opt-in) is deleted, so no training since the last periodic
checkpoint is lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator import labels as L
from kuberl.operator import naming
from kuberl.operator.builders import common
from kuberl.operator.builders.pinning import pins_for, with_pins

log = logging.getLogger("kuberl.operator.pins")
POLL_SECONDS = 2.0


async def ensure_pins(body: Any, exp: RLExperiment) -> RLExperiment:
    """`exp` with every pin annotation: those it lacks are written onto the RLExperiment (once)."""
    from kuberl.operator.lifecycle import kube

    if all(k in (exp.metadata.annotations or {}) for k in L.PIN_ANNOTATIONS):
        return exp
    ns = exp.namespace
    live = [w for w in (await kube().get("StatefulSet", ns, naming.rollout_name(exp)),
                        await kube().get("Job", ns, naming.trainer_name(exp))) if w]
    pins = pins_for(exp, common.IMAGE_REPOSITORY, live)
    if pins:
        await kube().patch("RLExperiment", ns, exp.name, {"metadata": {"annotations": pins}})
        log.info("%s/%s pinned: %s", ns, exp.name, pins)
    return with_pins(exp, pins)


def _running(job: dict[str, Any] | None) -> bool:
    from kuberl.operator.rules import trainer_running

    return trainer_running(job) and bool(((job or {}).get("status") or {}).get("active"))


async def checkpoint_before_recreate(body: Any, live_job: dict[str, Any] | None, why: str) -> bool:
    """Ask a running trainer for a checkpoint and wait for it (at most CONFIG.checkpoint_timeout);
    True when one was written. A trainer with no active pod has nothing to save."""
    from kuberl.operator.handlers import parse_experiment
    from kuberl.operator.lifecycle import CONFIG, bus_endpoint, event
    from kuberl.operator.rules import checkpoint_answered

    if not _running(live_job):
        return False
    exp = parse_experiment(body)
    url, token = await bus_endpoint(exp)
    run = naming.bus_run(exp)
    asked_at = time.time()
    asked = await CONFIG.bus.request_checkpoint(url, token, exp.name, f"recreate-{asked_at:.0f}", run=run)
    await event(body, "Normal", "CheckpointRequested",
                f"asked the trainer for a checkpoint before re-creating its Job ({why})" if asked
                else f"the bus is unreachable: re-creating the trainer Job without a fresh checkpoint ({why})")
    while asked and time.time() - asked_at < CONFIG.checkpoint_timeout:
        if checkpoint_answered(await CONFIG.bus.read(url, token, exp.name, run=run), asked_at):
            return True
        await asyncio.sleep(POLL_SECONDS)
    if asked:
        await event(body, "Warning", "CheckpointRequested", f"no checkpoint within {CONFIG.checkpoint_timeout:.0f}s: re-creating anyway")
    return False
