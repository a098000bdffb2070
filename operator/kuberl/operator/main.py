"""`kuberl operator`: runs the kopf operator (handlers in kuberl.operator.handlers) with KubeRL's settings.

Called by kuberl.cli (`main(args)`). Settings: watch timeouts (server and client side, so a silent
connection is noticed), peering (one active replica: each pod peers with its own priority, derived
from its name, so the others stand by; --standalone disables it), event posting level,
JSON logs, kopf's liveness endpoint on --health-port and Prometheus metrics on --metrics-port; the
repository of the default runtime images from $KUBERL_RUNTIME_IMAGE_REPOSITORY, and the operator's
namespace from $POD_NAMESPACE (the bus NetworkPolicies admit the operator from there only).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import socket
import sys
from collections.abc import Mapping
from typing import Any

PEERING_NAME = "kuberl"
# The repository of the default runtime images (<repository>/runtime-<flavour>:<version>); unset or
# empty: ghcr.io/kuberl. Pods whose spec names an image are not affected.
RUNTIME_IMAGE_REPOSITORY_ENV = "KUBERL_RUNTIME_IMAGE_REPOSITORY"
# The NATS image of embedded buses (unset or empty: nats:2.15-alpine); the chart's runtimeImages.nats.
NATS_IMAGE_ENV = "KUBERL_NATS_IMAGE"
# The chart sets it when replicaCount > 1: without the peering CRDs the replicas must not start at all
# (kopf would otherwise run each of them alone, all active at once).
PEERING_MANDATORY_ENV = "KUBERL_PEERING_MANDATORY"


def peering_priority(pod_name: str | None) -> int:
    """This replica's kopf peering priority: 0..2**31-1 from a hash of its pod name (the Downward API's
    $POD_NAME), so two replicas practically never tie. kopf pauses every peer that sees a live peer of
    higher priority, and *all* peers that tie (so equal priorities, kopf's default, pause everyone):
    distinct priorities leave exactly one replica working, the others standing by until its peering
    record expires."""
    if not pod_name:
        return 0
    return int(hashlib.sha256(pod_name.encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def configure_settings(settings: object, *, standalone: bool, clusterwide: bool, priority: int = 0,
                       mandatory: bool = False) -> None:
    """Apply KubeRL's kopf settings (kept apart from main() so a unit test can check them)."""
    import kopf

    assert isinstance(settings, kopf.OperatorSettings)
    settings.watching.server_timeout = 300  # the API server closes the watch; kopf re-lists from the last rv
    settings.watching.client_timeout = 330  # and a silent connection is dropped client-side soon after
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    settings.posting.level = logging.INFO  # kopf.info/warn events from handlers; not debug chatter
    settings.posting.reporting_component = "kuberl-operator"
    settings.posting.event_name_prefix = "kuberl-"
    settings.peering.name = PEERING_NAME
    settings.peering.standalone = standalone
    settings.peering.clusterwide = clusterwide
    settings.peering.priority = priority
    from kuberl.operator.cache import WATCHED

    for resource, selector in WATCHED.items():  # the children's watch caches: only labelled objects
        settings.watching.label_selectors[resource] = selector
    # Without the peering CRD (e.g. a cluster where only the CRD of experiments was applied) run alone, with a warning;
    # several replicas must not.
    settings.peering.mandatory = mandatory
    # Keep kopf's bookkeeping in annotations: the status schema (a structural CRD) prunes unknown fields.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kuberl.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="kuberl.io", key="last-handled-configuration")
    settings.persistence.finalizer = "kuberl.io/kopf-finalizer"
    settings.execution.max_workers = 8
    # On deletion kopf waits for a running monitor tick before releasing its finalizer; by default it
    # re-checks only after 60 s. A tick takes well under a second: wait for it briefly, poll often.
    settings.background.instant_exit_timeout = 2.0
    settings.background.cancellation_polling = 2


def configure_runtime_images(environ: Mapping[str, str]) -> str:
    """Read $KUBERL_RUNTIME_IMAGE_REPOSITORY once, at start-up, and hand it to the pod builders
    (the chart sets it from runtimeImages.repository); returns the repository in force. A bad value
    raises ValueError naming the variable."""
    from kuberl.operator.builders import common

    try:
        return common.configure_images(environ.get(RUNTIME_IMAGE_REPOSITORY_ENV))
    except ValueError as exc:
        raise ValueError(f"{RUNTIME_IMAGE_REPOSITORY_ENV}: {exc}") from None


def main(args: argparse.Namespace) -> int:
    import kopf
    from kubernetes.config import ConfigException

    try:  # bad settings and missing credentials are one clear line, not a traceback from inside kopf
        from kuberl.operator import handlers, metrics
        from kuberl.operator.kube import KubeClient

        runtime_images = configure_runtime_images(os.environ)
        from kuberl.operator.builders import bus, network

        network.configure_operator_namespace(os.environ.get("POD_NAMESPACE"))
        try:
            bus.configure_nats_image(os.environ.get(NATS_IMAGE_ENV))
        except ValueError as exc:
            raise ValueError(f"{NATS_IMAGE_ENV}: {exc}") from None
        handlers.CONFIG.kube = KubeClient.from_environment()
    except (ValueError, ConfigException) as exc:
        print(f"kuberl operator: {exc}", file=sys.stderr)
        return 2

    kopf.configure(log_format=kopf.LogFormat.JSON, verbose=bool(os.environ.get("KUBERL_OPERATOR_DEBUG")))
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # kopf logs every successful timer run at INFO: once per experiment per interval is noise.
    logging.getLogger("kopf.objects").addFilter(lambda r: not r.getMessage().startswith("Timer 'monitor' succeeded"))
    namespaces = list(args.namespace or [])
    clusterwide = not namespaces
    try:
        metrics.serve(args.metrics_port)
    except OSError as exc:
        print(f"kuberl operator: --metrics-port {args.metrics_port}: {exc}", file=sys.stderr)
        return 2

    @kopf.on.startup(id="kuberl-settings")
    def _settings(settings: kopf.OperatorSettings, **_: object) -> None:
        configure_settings(settings, standalone=args.standalone, clusterwide=clusterwide,
                           priority=peering_priority(os.environ.get("POD_NAME")),
                           mandatory=os.environ.get(PEERING_MANDATORY_ENV, "").lower() in ("1", "true", "yes"))

    elector = None
    if getattr(args, "leader_election", False):
        from kuberl.operator.leader import Elector

        if not os.environ.get("POD_NAMESPACE"):
            print("kuberl operator: --leader-election needs $POD_NAMESPACE (the Lease's namespace)", file=sys.stderr)
            return 2
        elector = Elector(KubeClient.from_environment(), os.environ["POD_NAMESPACE"], os.environ.get("POD_NAME") or socket.gethostname())
        args.standalone = True  # the Lease decides who works: no kopf peering besides
    liveness = f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None
    logging.getLogger("kuberl.operator").info(
        "starting: %s, metrics port %s, health port %s, %s, runtime images from %s",
        "cluster-wide" if clusterwide else f"namespaces {namespaces}", args.metrics_port or "off", args.health_port or "off",
        f"leader election by Lease {elector.namespace}/{elector.name} as {elector.identity}" if elector else
        "standalone" if args.standalone else f"peering {PEERING_NAME}", runtime_images)

    def operator() -> Any:
        return kopf.operator(standalone=args.standalone, clusterwide=clusterwide, namespaces=namespaces,
                             liveness_endpoint=liveness, peering_name=PEERING_NAME if not args.standalone else None)

    try:
        asyncio.run(operator() if elector is None else elected(elector, operator, args.health_port))
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # kuberl.operator.leader.LeadershipLost: exit, restart as a standby
        if type(exc).__name__ != "LeadershipLost":
            raise
        print(f"kuberl operator: {exc}", file=sys.stderr)
        return 1
    return 0


async def elected(elector: Any, operator: Any, health_port: int) -> None:
    """Wait for the Lease, answering liveness probes as a standby meanwhile (kopf, which serves them once it runs,
    starts only when this replica leads); then run kopf while the Lease is held (kuberl.operator.leader.lead)."""
    from aiohttp import web

    from kuberl.operator.leader import lead

    runner = None
    if health_port:
        app = web.Application()
        app.router.add_get("/healthz", lambda _: web.json_response({"standby": elector.identity}))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "0.0.0.0", health_port, reuse_address=True).start()
    try:
        await elector.acquire()
    finally:
        if runner is not None:
            await runner.cleanup()  # kopf binds the same port for its own liveness endpoint
    await lead(elector, operator())
