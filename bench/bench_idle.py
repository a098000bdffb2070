"""Does an idle engine spin? CPU used by a vLLM CPU engine (its whole process tree) while it has nothing to do.

Starts the engine as `kuberl run` does (the quickstart's model and settings, the environment `kuberl run`
gives an engine on one core: OpenMP threads bound to it), sends one burst of generations, then measures
the CPU the server, its engine core and its worker use over the next seconds, in which nothing asks
anything. An engine that spins (busy-polling its queue, OpenMP threads spin-waiting) would show up
as most of a core. Usage:
    flock /tmp/kuberl-heavy.lock python bench/bench_idle.py [--seconds 10] [--core 0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def tree_cpu(pid: int, seconds: float) -> tuple[float, list[tuple[str, float]]]:
    """CPU of `pid` and its descendants over `seconds`, in % of one core (total, per process)."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for p in procs:
        p.cpu_percent(None)
    time.sleep(seconds)
    rows = []
    for p in procs:
        try:
            rows.append((" ".join(p.cmdline())[:50] or p.name(), p.cpu_percent(None)))
        except psutil.NoSuchProcess:
            pass
    return sum(c for _, c in rows), rows


async def burst(url: str, prompt: list[int], n: int) -> None:
    from kuberl.runtime.inference.base import GenerateRequest
    from kuberl.runtime.inference.vllm import VLLMEngine

    engine = VLLMEngine(url=url)
    try:
        await asyncio.gather(*(engine.generate(GenerateRequest(input_ids=prompt, max_new_tokens=16, temperature=1.0)) for _ in range(n)))
    finally:
        await engine.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="how long to measure the idle engine")
    ap.add_argument("--core", type=int, default=0, help="the core the engine gets (as kuberl run would give it)")
    args = ap.parse_args()

    from kuberl.api import load_experiment
    from kuberl.net import free_port
    from kuberl.runtime.inference.main import engine_settings
    from kuberl.runtime.inference.vllm import build_server_command, server_env
    from kuberl.runtime.models import resolve_model
    from kuberl.runtime.resources import process_settings

    exp = load_experiment(ROOT / "examples" / "quickstart-cpu.yaml")
    work = Path(tempfile.mkdtemp(prefix="kuberl-bench-idle-"))
    model = resolve_model(exp.spec.model, str(work))
    port = free_port()
    cmd = build_server_command(model, port=port, **engine_settings(exp))
    cpus, extra = process_settings("engine", {"KUBERL_CPUS": str(args.core)}, [args.core], None)
    env = {**server_env(), **extra}
    log = open(work / "engine.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                if proc.poll() is not None:
                    raise SystemExit(f"the engine exited with {proc.returncode}; see {work / 'engine.log'}") from None
                time.sleep(1)
        t0 = time.monotonic()
        asyncio.run(burst(url, [1, 2, 3, 4, 5, 6, 7, 8], 64))
        print(f"burst: 64 generations of 16 tokens in {time.monotonic() - t0:.2f} s")
        total, rows = tree_cpu(proc.pid, args.seconds)
        for name, c in rows:
            print(f"  {c:5.1f}%  {name}")
        print(f"idle engine (nothing asked for {args.seconds:.0f} s after the burst): {total:.1f}% of one core "
              f"({'spins' if total > 20 else 'does not spin'})")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
