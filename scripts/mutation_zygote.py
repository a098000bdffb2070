"""The mutation check's fork server: imports the mutants' heavy third-party modules once, then forks one pytest per mutant.

A mutant's tests take a few seconds; starting Python and importing torch, transformers, peft and openai for them took
8-14 CPU-seconds each time (46 mutants: most of the tier). This process, started with the copy as its working directory
and the copy first on PYTHONPATH (scripts/mutation-check.py's env_for), imports only modules from outside the copy
(never kuberl or the tests: a forked child must import the mutated files, not a parent's unmutated ones), then reads one
JSON request per line on stdin: {"args": [...], "out": FILE, "timeout": SECONDS}. For each it forks; the child, in a
session of its own with stdout and stderr in FILE, runs pytest with those arguments and exits with pytest's code; the server
answers {"code": N} on stdout (-1 after the timeout, when it kills the child's whole session).
MUTATION_ZYGOTE_PRELOAD (comma-separated module names) replaces PRELOAD, for tests.

Run by scripts/mutation-check.py (`Zygote`), never by hand.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time

# What the mutants' tests import from outside the copy, heaviest first (a module missing here is only not preloaded).
PRELOAD = ("torch", "torch.distributed", "numpy", "transformers", "transformers.models.qwen2.modeling_qwen2", "peft", "safetensors.torch",
           "openai", "nats", "yaml", "pydantic", "httpx", "aiohttp", "pytest", "_pytest.python", "pytest_asyncio", "pytest_timeout", "anyio")


def preload() -> None:
    names = os.environ["MUTATION_ZYGOTE_PRELOAD"].split(",") if os.environ.get("MUTATION_ZYGOTE_PRELOAD") else PRELOAD
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional module: its tests import it themselves
            pass
    ours = sorted(m for m in sys.modules if m == "kuberl" or m.startswith(("kuberl.", "tests.")) or m == "tests")
    if ours:
        raise SystemExit(f"mutation_zygote: preloading imported {ours[:5]}: a forked test would run unmutated code")


def run_child(args: list[str], out: str) -> None:
    """In the forked child: pytest with `args`, its output in `out`; never returns."""
    code = 3
    try:
        os.setsid()
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        import pytest

        code = int(pytest.main(args))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def wait(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    try:
        os.killpg(pid, signal.SIGKILL)  # the child's session: its pytest and what that started (gloo ranks)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
    return -1


def main() -> None:
    preload()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_child(request["args"], request["out"])
        print(json.dumps({"code": wait(pid, float(request["timeout"]))}), flush=True)


if __name__ == "__main__":
    main()
