"""`kuberl run` with workflow.sandbox.placement pod: the launcher starts the sandbox server as a process of its own on a
loopback port, points the rollout agents at it, and stops it with the run.

The agent (written here, imported by the rollout agent from PYTHONPATH) makes one model call, runs code through
`ctx.run_python`, and returns 1.0 only when the code ran on the sandbox server (ctx.sandbox_client set, the right
output) and could not read the launcher's secret: so a reward of 1.0 on every step says each episode's code went
through the server. The server's log shows the runs; no server process outlives the run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.integration.test_run import ROOT, processes_mentioning, quickstart_manifest, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

STEPS = 2
AGENT_MODULE = "kuberl_test_sandbox_agent"
SECRET = "launcher-secret-5e1b"
AGENT_SOURCE = '''
import sys


async def agent(client, item, ctx):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": item.prompt}], max_tokens=2)
    if ctx.sandbox_client is None:
        return 0.0
    r = await ctx.run_python("import os\\nprint(6 * 7)\\nprint(sorted(os.environ))")
    if not (r.ok and r.stdout.startswith("42\\n") and "KUBERL_TEST_SECRET" not in r.stdout):
        print(f"sandbox-agent: tool call failed: {r}", file=sys.stderr)
        return 0.0
    return 1.0
'''


def test_kuberl_run_runs_tool_code_on_its_own_sandbox_server(tmp_path) -> None:
    (tmp_path / f"{AGENT_MODULE}.py").write_text(textwrap.dedent(AGENT_SOURCE))
    manifest = quickstart_manifest(tmp_path, "sandbox-run", **{
        "training.totalSteps": STEPS, "algorithm.batchSize": 4, "algorithm.samplesPerPrompt": 2,
        "workflow": {"type": "agent", "agent": f"{AGENT_MODULE}:agent", "reward": "repeat-digit",
                     "sandbox": {"placement": "pod", "timeoutSeconds": 10}},
    })
    workdir = tmp_path / "work"
    env = dict(os.environ, KUBERL_TEST_SECRET=SECRET,
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=800, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "sandbox" in proc.stdout.split("started", 1)[1].splitlines()[0], proc.stdout[:2000]
    metrics = read_metrics(workdir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["reward_mean"] == 1.0 for m in metrics), [m["reward_mean"] for m in metrics]
    log = (workdir / "logs" / "sandbox.log").read_text()
    port = re.search(r"sandbox server on 127\.0\.0\.1:(\d+)", log)
    assert port, log[-2000:]
    assert not [p for p in processes_mentioning("kuberl.runtime.rollout.sandbox_server") if f"{port.group(1)}" in " ".join(p.cmdline())]
    assert SECRET not in log
