"""`kuberl rollout --config FILE`: the rollout agent of one rollout pod (or of one local replica in `kuberl run`).

Engine: attaches to $KUBERL_ENGINE_URL (the pod's engine container), or starts its own engine when it
is unset. Bus: --bus-url, $KUBERL_BUS_URL or spec.bus.external.url. Exit codes (contracts.md):
0 stopped (SIGTERM), 1 failed (retryable), 2 configuration error: bad arguments, or a model, data set
or workflow setting the agent cannot set up from (the reason also goes to the termination message).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import tempfile
from typing import TYPE_CHECKING

from pydantic import ValidationError

from kuberl.api import RLExperiment, load_experiment
from kuberl.runtime.errors import ConfigError, config_error_exit, spec_errors

if TYPE_CHECKING:
    from kuberl.runtime.rollout.health import AgentHealth

log = logging.getLogger("kuberl.rollout")


def resolve_bus_url(exp: RLExperiment, flag: str | None) -> str:
    url = flag or os.environ.get("KUBERL_BUS_URL") or (exp.spec.bus.external.url if exp.spec.bus.external else None)
    if not url:
        raise ValueError("bus URL: pass --bus-url, set $KUBERL_BUS_URL, or set spec.bus.external.url (e.g. nats://127.0.0.1:4222)")
    return url


def make_engine(exp: RLExperiment, model_path: str, url: str | None):
    """The engine client: attached to `url`, or launching its own server on a free port."""
    from kuberl.runtime.inference.base import engine_class
    from kuberl.runtime.inference.main import engine_settings

    cls = engine_class(exp.spec.rollout.engine)
    if url:
        return cls(url=url)
    settings = engine_settings(exp)
    settings.pop("seed", None)
    return cls(model_path, **settings)


async def run_agent(exp: RLExperiment, bus_url: str, workdir: str, engine_url: str | None, max_tickets: int | None = None) -> int:
    from kuberl.runtime.rollout.health import AgentHealth, health_port, start_health_server

    health = AgentHealth()
    port = health_port()  # set in pods (the rollout StatefulSet's probes); unset in `kuberl run`
    probes = await start_health_server(health, port) if port is not None else None
    try:
        return await _run_agent(exp, bus_url, workdir, engine_url, max_tickets, health)
    finally:
        if probes is not None:
            await probes.cleanup()


async def _run_agent(exp: RLExperiment, bus_url: str, workdir: str, engine_url: str | None, max_tickets: int | None,
                     health: AgentHealth) -> int:
    from transformers import AutoTokenizer

    from kuberl.runtime.bus import Bus
    from kuberl.runtime.data import load_items
    from kuberl.runtime.evaluation import Evaluator
    from kuberl.runtime.inference.main import BUILTIN_MAX_MODEL_LEN
    from kuberl.runtime.models import resolve_model
    from kuberl.runtime.rollout.agent import RolloutAgent
    from kuberl.runtime.rollout.workflows import make_workflow

    spec = exp.spec
    with spec_errors():  # what the spec names but cannot be had: ConfigError, exit 2
        model_path = resolve_model(spec.model, workdir)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    with spec_errors():
        items = load_items(spec.dataset, seed=spec.seed)
        max_total = BUILTIN_MAX_MODEL_LEN if spec.model.builtin is not None else None
        workflow = make_workflow(spec, tokenizer, max_total_tokens=max_total)
        evaluator = Evaluator.from_experiment(spec, tokenizer, max_total_tokens=max_total)  # None without spec.evaluation
        engine = make_engine(exp, model_path, engine_url)
    log.info("experiment %s: %d items, engine %s at %s, bus %s", exp.name, len(items), spec.rollout.engine, engine.url, bus_url)
    bus = await Bus.connect(bus_url, exp.name, max_payload=spec.bus.max_payload, name=f"kuberl-rollout-{os.getpid()}")
    health.bus, health.engine = bus, engine
    try:
        await engine.start()
        if (attach := getattr(workflow, "attach", None)) is not None:
            await attach(engine)  # workflow.external: the episode API serves before the first ticket (episode_api.py)
        agent = health.agent = RolloutAgent(exp, bus, engine, workflow, items, workdir=workdir, evaluator=evaluator)
        stats = await agent.run(max_tickets=max_tickets)
        log.info("agent stopped: %s", stats)
    finally:
        await engine.stop()
        await bus.close()
    return 0


def protect_agent() -> None:
    """Keep this process's environment (bus password, engine key, hub token) and memory from every other process of
    its user (PR_SET_DUMPABLE 0: model-written tool code above all), and say once what confines the tool sandbox."""
    from kuberl.runtime.rollout import confine

    if not confine.protect_process():
        log.warning("PR_SET_DUMPABLE failed: processes of this user may read this agent's /proc files")
    layers = confine.probe()
    if not any(layer.startswith("landlock") for layer in layers):
        log.warning("this kernel offers no Landlock (Linux 5.13+, `landlock` in the boot's lsm=): the tool sandbox cannot keep "
                    "tool code from reading files this agent can read; it runs with %s", ", ".join(layers))
    else:
        log.info("tool sandbox confinement: %s", ", ".join(layers))


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s [rollout] %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("nats", "httpx", "transformers", "urllib3", "aiohttp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        exp = load_experiment(args.config)
        bus_url = resolve_bus_url(exp, getattr(args, "bus_url", None))
    except (ValueError, ValidationError, OSError) as exc:
        return config_error_exit("rollout", exc)
    protect_agent()
    workdir = getattr(args, "workdir", None) or os.environ.get("KUBERL_WORKDIR") or os.path.join(tempfile.gettempdir(), "kuberl")
    os.makedirs(workdir, exist_ok=True)
    engine_url = os.environ.get("KUBERL_ENGINE_URL") or None

    async def runner() -> int:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        # SIGTERM (pod deletion, `kuberl run` stopping): cancel, so in-flight tickets are given back.
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            return await run_agent(exp, bus_url, workdir, engine_url)
        except asyncio.CancelledError:
            log.info("stopping on signal")
            return 0

    try:
        return asyncio.run(runner())
    except ConfigError as exc:  # found while setting up: a restart cannot fix it
        return config_error_exit("rollout", exc)
    except Exception:
        log.exception("rollout agent failed")
        return 1
