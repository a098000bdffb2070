"""The `kuberl` command line: user commands (run, validate, render, crd, operator) and the in-pod role entry points.

Each subcommand lives in its role's module and is imported only when called, so `kuberl validate`
never loads torch and `kuberl trainer` never loads kopf. The operator renders exactly these commands
into the pods it creates, and the Dockerfiles use them as entrypoints.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable

# name -> (module:function, help, arguments adder)
Adder = Callable[[argparse.ArgumentParser], None]


def _config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="RLExperiment manifest (the runtime ConfigMap mounts it at /etc/kuberl/experiment.yaml)")
    p.add_argument("--bus-url", default=None, help="NATS URL (default: from the manifest or $KUBERL_BUS_URL)")
    p.add_argument("--workdir", default=None, help="Shared folder for weights and checkpoints (default: $KUBERL_WORKDIR)")


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="RLExperiment manifest")
    p.add_argument("--workdir", default=None, help="Where weights, checkpoints, metrics and plots go (default: ./runs/<name>)")
    p.add_argument("--bus-url", default=None, help="Use this NATS server instead of starting one")
    p.add_argument("--max-steps", type=int, default=None, help="Stop after this many steps (overrides the manifest)")
    p.add_argument("--resume", action="store_true", help="Continue from the latest checkpoint in --workdir")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="Place the roles on this Ray cluster (host:port, or auto: Ray's own address resolution) instead of this machine; "
                        "needs pip install 'kuberl-runtime[ray]' and a workdir every node sees")


def _plot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="A run's workdir (or its metrics.jsonl), or the name of a cluster experiment (read from its bus)")
    p.add_argument("-o", "--output", default=None, help="PNG to write (default: <workdir>/curves.png, or ./<experiment>-curves.png)")
    p.add_argument("-n", "--namespace", default=None, help="Namespace of a cluster experiment (default: default)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig for a cluster experiment (default: kubectl's: $KUBECONFIG or ~/.kube/config)")
    p.add_argument("--context", default=None, help="kubeconfig context for a cluster experiment (default: the current one)")


def _validate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", help="Manifests to check as admission would")


def _render_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", help="RLExperiment manifests")
    p.add_argument("-n", "--namespace", default=None, help="Namespace of experiments that name none (default: default)")
    p.add_argument("--runtime-image-repository", default=None,
                   help="The operator's runtime image repository (default: $KUBERL_RUNTIME_IMAGE_REPOSITORY, else ghcr.io/kuberl)")
    p.add_argument("--nats-image", default=None, help="The operator's NATS image (default: $KUBERL_NATS_IMAGE, else nats:2.15-alpine)")


def _crd_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", default=None, help="Write here instead of stdout (a file, or a folder for crds/)")
    p.add_argument("--check", action="store_true", help="Exit non-zero if --output differs from the generated CRD")


def _operator_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", "-n", action="append", default=None, help="Watch only these namespaces (default: all)")
    p.add_argument("--metrics-port", type=int, default=8080, help="Prometheus metrics port (0 = off)")
    p.add_argument("--health-port", type=int, default=8081, help="Liveness endpoint port (0 = off)")
    p.add_argument("--standalone", action="store_true", help="No peering (a single operator replica, e.g. for tests)")
    p.add_argument("--leader-election", action="store_true",
                   help="Work only while holding the Lease kuberl-operator in $POD_NAMESPACE (several replicas: one works, the others stand by)")


def _engine_args(p: argparse.ArgumentParser) -> None:
    _config_arg(p)
    p.add_argument("--port", type=int, default=8000, help="Port the engine server listens on")
    p.add_argument("--host", default="0.0.0.0", help="Address the engine server binds")


def _build_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("output", help="Folder to write the tiny model and tokenizer into")
    p.add_argument("--seed", type=int, default=0)


def _bus_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=4222)
    p.add_argument("--store-dir", default="/data/jetstream")
    p.add_argument("--max-payload", default="8MB")


COMMANDS: dict[str, tuple[str, str, Adder]] = {
    "run": ("kuberl.runtime.launcher:main", "Run an RLExperiment on this machine (no cluster needed)", _run_args),
    "plot": ("kuberl.runtime.plot:main", "Draw a run's reward, entropy, staleness and eval curves to a PNG", _plot_args),
    "validate": ("kuberl.api.validation:main", "Check manifests as admission would (schema, CEL rules, model checks)", _validate_args),
    "render": ("kuberl.operator.render:main", "Print the objects the operator would create for manifests (review, diff, scan)", _render_args),
    "crd": ("kuberl.api.crd:main", "Print the CustomResourceDefinition generated from the API models", _crd_args),
    "operator": ("kuberl.operator.main:main", "Run the kopf operator", _operator_args),
    "trainer": ("kuberl.runtime.trainer.main:main", "In-pod role: the trainer (torchrun launches one per rank)", _config_arg),
    "rollout": ("kuberl.runtime.rollout.main:main", "In-pod role: the rollout agent next to an engine", _config_arg),
    "engine": ("kuberl.runtime.inference.main:main", "In-pod role: start the inference engine server for the manifest", _engine_args),
    "bus": ("kuberl.runtime.bus.server:main", "In-pod role: nats-server with JetStream", _bus_args),
    "build-model": ("kuberl.runtime.models:main", "Build the tiny test model (random init, local tokenizer) into a folder", _build_model_args),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kuberl", description="Fully asynchronous RL for LLMs, on Kubernetes or one machine.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (target, help_text, add) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add(p)
        p.set_defaults(_target=target)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module_name, func_name = args._target.split(":")
    if args.command in ("engine", "rollout", "trainer"):  # cores and thread pools, before torch or vLLM start threads
        from kuberl.runtime.resources import ResourceError, apply_process_resources

        try:
            apply_process_resources(args.command, getattr(args, "config", None))
        except ResourceError as exc:
            print(f"kuberl {args.command}: {exc}", file=sys.stderr)
            return 2
    if argv is None and args.command in ("engine", "rollout", "trainer", "bus"):
        # This process is the role (not a caller running one in-process): it ends with its launcher or its parent. After
        # the resources above: its watchdog thread gets the process's cores and scheduling policy.
        from kuberl.runtime.lifetime import watch_parent

        watch_parent()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == module_name or module_name.startswith(exc.name + ".")):
            print(f"kuberl {args.command}: not available in this install ({exc.name} is missing)", file=sys.stderr)
            return 2
        extra = {"kopf": "operator", "torch": "runtime", "nats": "runtime", "transformers": "runtime"}.get((exc.name or "").split(".")[0])
        hint = f"; install it with: pip install 'kuberl[{extra}]'" if extra else ""
        print(f"kuberl {args.command}: missing dependency {exc.name}{hint}", file=sys.stderr)
        return 2
    result = int(getattr(module, func_name)(args) or 0)
    if argv is None and args.command == "run":
        # The launcher's own process, its run over: exit without Python's teardown of the torch it loaded (1-2 s on a
        # busy machine), which would count against the bound of a stop (SIGTERM, Ctrl-C: kuberl.runtime.lifetime).
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:  # its terminal is gone (SIGHUP)
                pass
        os._exit(result)
    return result


if __name__ == "__main__":
    sys.exit(main())
