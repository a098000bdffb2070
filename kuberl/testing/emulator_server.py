"""Runs the strict Kubernetes API emulator (kuberl.testing.kmock_strict) as a server, and its CLI.

`EmulatorServer` serves a StrictKubernetesEmulator on a free loopback port in a background thread
(its own event loop), seeds namespaces, Nodes and CRDs, and writes a kubeconfig for kubectl, kopf and
the `kubernetes` client. Used by tests/integration/test_operator*.py, e2e_tests/conftest.py and
`python -m kuberl.testing.kmock_strict --kubeconfig /tmp/kubeconfig`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Self

import yaml

Obj = dict[str, Any]


def load_crds(paths: Iterable[str | Path]) -> list[Obj]:
    """CustomResourceDefinitions from YAML files or folders of them."""
    out = []
    for p in paths:
        p = Path(p)
        files = sorted(p.glob("*.yaml")) + sorted(p.glob("*.yml")) if p.is_dir() else [p]
        for f in files:
            out += [d for d in yaml.safe_load_all(f.read_text()) if d and d.get("kind") == "CustomResourceDefinition"]
    return out


def default_crds() -> list[Obj]:
    """KubeRL's CRD: crds/ of this checkout if present, else generated from the API models."""
    folder = Path(__file__).resolve().parents[2] / "crds"  # the checkout's crds/, next to kuberl/
    crds = load_crds([folder]) if folder.is_dir() else []
    if crds:
        return crds
    from kuberl.api.crd import build_crd  # engineer A's generator

    return [build_crd()]


class EmulatorServer:
    """Runs a StrictKubernetesEmulator on a free loopback port in a background thread.

    with EmulatorServer(crds=default_crds()) as srv:
        srv.write_kubeconfig(tmp / "kubeconfig")
        srv.call(lambda emu: emu.get_object(("apps", "v1", "statefulsets"), "default", "x"))
    """

    def __init__(self, crds: list[Obj] | None = None, *, namespaces: Iterable[str] = ("default", "kube-system"),
                 nodes: list[Obj] | None = None, host: str = "127.0.0.1", port: int | None = None,
                 validate_builtins: bool = True):
        self.crds, self.namespaces, self.host, self.port_wanted = crds or [], list(namespaces), host, port
        self.nodes = nodes if nodes is not None else [cpu_node("node-0")]
        self.validate_builtins = validate_builtins
        self.emulator: Any = None  # the StrictKubernetesEmulator, once started
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def __enter__(self) -> Self:
        self._thread = threading.Thread(target=self._run, name="kmock-strict", daemon=True)
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"the emulator did not start: {self._error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported to __enter__, which raises it
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        import kmock

        from kuberl.testing.kmock_strict import StrictKubernetesEmulator

        emu = StrictKubernetesEmulator(validate_builtins=self.validate_builtins)
        async with emu, kmock.Server(emu, host=self.host, port=self.port_wanted) as server:
            for ns in self.namespaces:
                emu.seed({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
            for node in self.nodes:
                emu.seed({k: v for k, v in node.items() if k != "status"}, node.get("status"))
            for crd in self.crds:
                emu.seed(crd)
            self.emulator, self.url = emu, str(server.url).rstrip("/")
            self.port = server.port
            self._ready.set()
            await self._stop.wait()

    def call(self, fn: Any, timeout: float = 30) -> Any:
        """Run fn(emulator) inside the emulator's loop (thread-safe) and return its result."""
        assert self._loop is not None

        async def run() -> Any:
            return fn(self.emulator)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def write_kubeconfig(self, path: str | Path, namespace: str = "default") -> Path:
        """A kubeconfig whose current context points at this emulator (plain HTTP, no auth)."""
        path = Path(path)
        path.write_text(yaml.safe_dump(kubeconfig(self.url, namespace)))
        return path


def kubeconfig(url: str, namespace: str = "default") -> Obj:
    return {"apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": url}}],
            "users": [{"name": "kmock", "user": {"token": "kmock"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": namespace}}]}


def cpu_node(name: str, cpu: str = "16", memory: str = "64Gi", extra: dict[str, str] | None = None) -> Obj:
    """A ready Node with this allocatable capacity (extra: e.g. {"nvidia.com/gpu": "8"})."""
    alloc = {"cpu": cpu, "memory": memory, "pods": "110", **(extra or {})}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            "status": {"allocatable": alloc, "capacity": alloc,
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kmock"}]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kuberl.testing.kmock_strict",
                                     description="Serve the strict Kubernetes API emulator (kmock) on a loopback port.")
    parser.add_argument("--port", type=int, default=0, help="Port (0 = a free one)")
    parser.add_argument("--kubeconfig", default=None, help="Write a kubeconfig for the emulator here")
    parser.add_argument("--crd", action="append", default=None, help="CRD file or folder to serve (default: KubeRL's)")
    parser.add_argument("--gpus", type=int, default=0, help="nvidia.com/gpu allocatable on the one Node")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.INFO if os.environ.get("KMOCK_ACCESS_LOG") else logging.WARNING)
    crds = load_crds(args.crd) if args.crd else default_crds()
    node = cpu_node("node-0", extra={"nvidia.com/gpu": str(args.gpus)} if args.gpus else None)
    with EmulatorServer(crds, nodes=[node], port=args.port or None) as srv:
        if args.kubeconfig:
            srv.write_kubeconfig(args.kubeconfig)
        print(f"kmock-strict serving {srv.url}" + (f", kubeconfig {args.kubeconfig}" if args.kubeconfig else ""), flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
    return 0
