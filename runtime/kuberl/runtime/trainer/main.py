"""`kuberl trainer --config FILE`: one trainer rank (torchrun starts one per process; without torchrun, one).

Reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR from torchrun's environment, the bus URL from --bus-url,
$KUBERL_BUS_URL or spec.bus.external.url, the workdir from --workdir or $KUBERL_WORKDIR. Exit codes
(docs/design/contracts.md): 0 done (or stopped by control.stop), 1 failed, retryable (progress.failed
says why), 2 configuration error: bad arguments, or a spec this trainer cannot run (the reason also
goes to the termination message and progress.failed; kuberl.runtime.errors), 143 SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from pydantic import ValidationError

from kuberl.api import RLExperiment, load_experiment
from kuberl.runtime.errors import config_error_exit


def _setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [trainer rank {rank}] %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("nats", "httpx", "transformers", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def resolve_bus_url(exp: RLExperiment, flag: str | None) -> str:
    """--bus-url, else $KUBERL_BUS_URL, else spec.bus.external.url; an embedded bus must be named by one of the first two."""
    url = flag or os.environ.get("KUBERL_BUS_URL") or (exp.spec.bus.external.url if exp.spec.bus.external else None)
    if not url:
        raise ValueError("bus URL: pass --bus-url, set $KUBERL_BUS_URL, or set spec.bus.external.url (e.g. nats://127.0.0.1:4222)")
    return url


def resolve_workdir(flag: str | None) -> str:
    workdir = flag or os.environ.get("KUBERL_WORKDIR")
    if not workdir:
        raise ValueError("workdir: pass --workdir or set $KUBERL_WORKDIR (the shared folder for weights and checkpoints)")
    return workdir


def main(args: argparse.Namespace) -> int:
    _setup_logging()
    log = logging.getLogger("kuberl.trainer")
    try:
        exp = load_experiment(args.config)
        bus_url = resolve_bus_url(exp, getattr(args, "bus_url", None))
        workdir = resolve_workdir(getattr(args, "workdir", None))
    except (ValueError, ValidationError, OSError) as exc:
        return config_error_exit("trainer", exc)
    os.makedirs(workdir, exist_ok=True)
    from kuberl.runtime.trainer.trainer import Trainer

    log.info("experiment %s: workdir %s", exp.name, workdir)
    try:
        trainer = Trainer(exp, bus_url=bus_url, workdir=workdir, bus_token=os.environ.get("KUBERL_BUS_TOKEN") or None)
    except ValueError as exc:  # a setting this trainer cannot run (e.g. an unsupported backend or algorithm)
        return config_error_exit("trainer", exc)
    # run() returns 2 itself for a configuration error found while setting up (model, data set).
    code = asyncio.run(trainer.run())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        exit_now(code)
    return code


def exit_now(code: int) -> None:
    """Leave a multi-rank trainer without the interpreter's teardown: torch 2.13's CPU/gloo teardown at exit
    aborts one 2-rank run in four here ("terminate called without an active exception", SIGABRT: exit -6 after
    a clean end, which torchrun and the Job report as a failure; tests/unit/test_packing.py's FSDP2 worker).
    Everything the trainer owns is closed by then (bus, trackers, process group); logs are flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
