"""The Python sandbox of tool-integrated reasoning (kuberl.runtime.rollout.sandbox) and the TIR agent on it.

Real processes, real limits: the sandbox refuses network access (its own network namespace, and the
audit hook on its own), kills runaway code at its CPU, memory and wall-clock limits, and the TIR
episode turns a failing tool into an error message for the model and a zero reward, never a crash.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import socket
import time

import pytest

from kuberl.api.v1alpha1 import SandboxSpec
from kuberl.runtime.agents.tir import MAX_TOOL_CALLS, math_with_python
from kuberl.runtime.data import Item
from kuberl.runtime.rewards import math_reward
from kuberl.runtime.rollout import confine
from kuberl.runtime.rollout.agent_workflow import AgentWorkflow
from kuberl.runtime.rollout.sandbox import OPEN_FILES_LIMIT, SandboxError, run_python
from kuberl.runtime.rollout.workflows import EpisodeContext
from tests.unit.test_agent_workflow import ScriptedEngine, sampling

FAST = SandboxSpec(timeout_seconds=2.0, cpu_seconds=1, memory_mib=256, max_output_chars=200)
# For the CPU limit: a wall-clock limit far above it, so that the CPU limit comes first also on a loaded machine
# (CI, 2026-11-28: two busy test workers on 2 cores gave the loop under 1 s of CPU in FAST's 2 s).
CPU_BOUND = SandboxSpec(timeout_seconds=10.0, cpu_seconds=1, memory_mib=256, max_output_chars=200)


def run(code: str, spec: SandboxSpec = FAST, **kw):
    return asyncio.run(run_python(code, spec, **kw))


@pytest.fixture
def listener():
    """A TCP server on the host's loopback that the sandboxed code must not reach."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    yield srv.getsockname()[1]
    srv.close()


CONNECT = "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('CONNECTED')"


class TestTheSandbox:
    def test_code_runs_and_its_output_comes_back(self):
        r = run("print(sum(i * i for i in range(10)))")
        assert r.ok and r.stdout == "285\n" and r.observation() == "285\n"

    def test_network_access_is_refused(self, listener):
        r = run(CONNECT.format(port=listener))
        assert not r.ok and "CONNECTED" not in r.stdout
        assert "network access is not allowed" in r.observation()

    def test_without_the_audit_hook_its_own_network_namespace_still_reaches_nothing(self, listener):
        # Control: the same code outside the sandbox connects.
        socket.create_connection(("127.0.0.1", listener), timeout=1).close()
        r = run(CONNECT.format(port=listener), audit_hook=False)
        if r.network != "netns":
            pytest.fail("the kernel refused a network namespace here; the audit hook is the only network barrier")
        assert not r.ok and "CONNECTED" not in r.stdout and ("Errno" in r.error or "Error" in r.error), r.error

    def test_a_busy_loop_is_killed_at_the_cpu_limit(self):
        t = time.monotonic()
        r = run("while True:\n    pass", CPU_BOUND)
        assert not r.ok and "CPU time limit" in r.error, r.error
        assert time.monotonic() - t < CPU_BOUND.timeout_seconds

    def test_a_sleeping_program_is_killed_at_the_wall_clock_limit(self):
        t = time.monotonic()
        r = run("import time\nprint('started', flush=True)\ntime.sleep(60)")
        assert r.timed_out and "timed out" in r.observation() and "started" in r.observation()
        assert time.monotonic() - t < FAST.timeout_seconds + 1

    def test_a_memory_bomb_hits_the_memory_limit(self):
        r = run("x = bytearray(2 * 1024 ** 3)\nprint('allocated')")
        assert not r.ok and "MemoryError" in r.error and "allocated" not in r.stdout

    def test_output_is_capped(self):
        r = run("print('x' * 100000)")
        assert r.ok and r.truncated and len(r.stdout) == FAST.max_output_chars

    @pytest.mark.parametrize("code, message", [
        ("open('/tmp/kuberl-sandbox-escape', 'w').write('x')", "writing /tmp/kuberl-sandbox-escape is not allowed"),
        ("import os\nos.fork()", "os.fork is not allowed"),
        ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen is not allowed"),
        ("import ctypes\nctypes.CDLL(None)", "ctypes.dlopen is not allowed"),
    ])
    def test_writes_outside_its_directory_processes_and_ctypes_are_refused(self, code, message):
        r = run(code)
        assert not r.ok and message in r.error

    def test_its_own_directory_is_writable(self):
        r = run("open('notes.txt', 'w').write('42')\nprint(open('notes.txt').read())")
        assert r.ok and r.stdout == "42\n"

    def test_a_caller_holding_many_descriptors_still_runs_code_and_the_run_gets_the_open_files_limit(self):
        """A busy agent holds more descriptors than a run may (connections to engines, the bus): the limit must not
        stop the confinement that needs descriptors before exec (CI, 2026-12-03: a test worker with ~70 open made
        Landlock's ruleset fail with EMFILE, and every run after with it)."""
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(OPEN_FILES_LIMIT + 16)]
        try:
            r = run("import os, resource\nprint(resource.getrlimit(resource.RLIMIT_NOFILE)[1])\n"
                    "fds = []\ntry:\n    while True:\n        fds.append(os.open('/dev/null', os.O_RDONLY))\n"
                    "except OSError as exc:\n    print(exc.errno)")
        finally:
            for fd in held:
                os.close(fd)
        assert r.ok, r.error
        limit, errno_ = r.stdout.split()
        assert int(limit) == OPEN_FILES_LIMIT and int(errno_) == errno.EMFILE  # the limit holds inside the run

    def test_a_confinement_that_fails_is_a_clear_error_naming_the_step(self, monkeypatch):
        def refused(home):
            raise OSError(errno.EMFILE, "landlock_create_ruleset")

        monkeypatch.setattr(confine, "confine", refused)  # the forked child runs the patched function
        with pytest.raises(SandboxError, match=r"could not confine the run: OSError: \[Errno 24\] landlock_create_ruleset"):
            run("print('never')")


def tool_call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


def run_tir(tokenizer, reply, spec=FAST):
    engine = ScriptedEngine(tokenizer, reply)
    # The episode's calls share maxNewTokens (exportStyle concat): room for MAX_TOOL_CALLS + 1 calls of ~80 tokens.
    wf = AgentWorkflow(math_with_python, tokenizer, sampling(tokenizer, n=2, max_new=1024), math_reward, reward_name="math",
                       timeout_seconds=60, sandbox=spec)

    async def go():
        try:
            return await wf.arun_episode(engine, Item(0, "What is 6 * 7?", "42"), EpisodeContext(ticket_id="t"))
        finally:
            await wf.aclose()

    return engine, wf, asyncio.run(go())


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from kuberl.runtime.models import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))


class TestToolIntegratedReasoning:
    def test_the_tools_output_goes_back_to_the_model_and_the_answer_is_scored(self, tokenizer):
        def reply(ids):
            text = tokenizer.decode(ids)
            return "The answer is #### 42" if "tool\n42" in text else tool_call("print(6 * 7)")

        engine, wf, samples = run_tir(tokenizer, reply)
        assert samples is not None and [s.reward for s in samples] == [1.0, 1.0]
        s = samples[0]
        masked = tokenizer.decode([t for t, m in zip(s.output_ids, s.loss_mask) if not m])
        assert "42" in masked  # the tool's output is in the sequence, never trained on
        assert s.num_turns == 2

    def test_a_tool_that_times_out_gives_the_model_an_error_and_the_episode_a_zero_reward(self, tokenizer):
        # CPU_BOUND: a 10 s wall clock, so that on loaded cores the loop reaches its 1 s of CPU before the wall limit
        engine, wf, samples = run_tir(tokenizer, lambda ids: tool_call("while True:\n    pass"), CPU_BOUND)
        assert samples is not None and [s.reward for s in samples] == [0.0, 0.0]
        assert samples[0].num_turns == MAX_TOOL_CALLS + 1
        last_prompt = tokenizer.decode(engine.calls[-1][0].input_ids)
        assert "Error: killed by SIGXCPU (CPU time limit)" in last_prompt
        assert not wf.stats.failed

    def test_code_that_raises_is_reported_to_the_model(self, tokenizer):
        def reply(ids):
            text = tokenizer.decode(ids)
            return "#### 7" if "ZeroDivisionError" in text else tool_call("print(1 / 0)")

        engine, _, samples = run_tir(tokenizer, reply)
        assert [s.reward for s in samples] == [0.0, 0.0]  # wrong answer, but a scored episode
        assert "Error: ZeroDivisionError: division by zero" in tokenizer.decode(engine.calls[-1][0].input_ids)
