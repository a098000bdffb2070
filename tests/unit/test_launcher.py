"""The local launcher's pure parts: GPU assignment, the resolved manifest, the role plan, the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kuberl.api import RLExperiment, load_experiment
from kuberl.runtime.launcher import LocalRun, assign_gpus, plot_rewards, prepare_manifest

ROOT = Path(__file__).resolve().parents[2]


def make_experiment(**spec) -> RLExperiment:
    base = {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}, "training": {"totalSteps": 3}}
    base.update(spec)
    return RLExperiment.model_validate({"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "t"}, "spec": base})


class TestGpuAssignment:
    def test_cpu_roles_get_no_devices(self):
        exp = make_experiment(rollout={"accelerator": {"type": "cpu", "count": 0}}, trainer={"accelerator": {"type": "cpu", "count": 1}})
        assert assign_gpus(exp, gpus=0) == {}

    def test_engines_and_trainer_get_disjoint_device_blocks(self):
        exp = make_experiment(rollout={"replicas": 2, "tensorParallelSize": 2, "accelerator": {"count": 2}}, trainer={"accelerator": {"count": 2}})
        assert assign_gpus(exp, gpus=8) == {
            "engine-0": {"CUDA_VISIBLE_DEVICES": "0,1"},
            "engine-1": {"CUDA_VISIBLE_DEVICES": "2,3"},
            "trainer": {"CUDA_VISIBLE_DEVICES": "4,5"},
        }

    def test_asking_for_more_gpus_than_the_machine_has_names_both_numbers(self):
        exp = make_experiment(rollout={"replicas": 2}, trainer={"accelerator": {"count": 2}})
        with pytest.raises(SystemExit, match="asks for 4 NVIDIA GPUs .* has 1"):
            assign_gpus(exp, gpus=1)


def test_the_resolved_manifest_carries_the_step_override_and_loads_back(tmp_path):
    exp = load_experiment(ROOT / "examples" / "quickstart.yaml")
    path = prepare_manifest(exp, tmp_path, max_steps=7)
    again = load_experiment(path)
    assert again.spec.training.total_steps == 7
    assert again.spec.model == exp.spec.model and "allocation" not in yaml.safe_load(path.read_text())["spec"]


def test_the_plan_runs_an_engine_and_an_agent_per_replica_and_torchrun_for_several_trainer_processes(tmp_path):
    exp = make_experiment(rollout={"engine": "vllm", "replicas": 2, "accelerator": {"type": "cpu", "count": 0}},
                          trainer={"accelerator": {"type": "cpu", "count": 2}})
    run = LocalRun(exp, tmp_path / "e.yaml", tmp_path, "nats://127.0.0.1:1")
    run.plan(gpus=0)
    assert [r.name for r in run.roles] == ["engine-0", "rollout-0", "engine-1", "rollout-1", "trainer"]
    engine_urls = {r.env["KUBERL_ENGINE_URL"] for r in run.roles if r.name.startswith("rollout")}
    assert len(engine_urls) == 2
    # torchrun through the wrapper that passes a rank's exit code 2 on (plain torchrun exits 1).
    assert "kuberl.runtime.trainer.torchrun" in run.trainer.argv and "--nproc-per-node=2" in run.trainer.argv
    logs = {r.name: r.env["KUBERL_TERMINATION_LOG"] for r in run.roles}
    assert logs["trainer"] == str(tmp_path / "logs" / "trainer.termination-log") and len(set(logs.values())) == len(logs)


def test_each_engine_port_is_held_for_the_run_so_that_a_restarted_engine_finds_it_free(tmp_path):
    import socket

    exp = make_experiment(rollout={"engine": "vllm", "replicas": 2, "accelerator": {"type": "cpu", "count": 0}},
                          trainer={"accelerator": {"type": "cpu", "count": 1}})
    run = LocalRun(exp, tmp_path / "e.yaml", tmp_path, "nats://127.0.0.1:1")
    run.plan(gpus=0)
    ports = [int(r.argv[r.argv.index("--port") + 1]) for r in run.roles if r.name.startswith("engine-")]
    urls = [r.env["KUBERL_ENGINE_URL"] for r in run.roles if r.name.startswith("rollout-")]
    assert urls == [f"http://127.0.0.1:{p}" for p in ports]
    for port in ports:
        with socket.socket() as other, pytest.raises(OSError, match="Address already in use"):
            other.bind(("127.0.0.1", port))  # another process, between the engine's starts
        for _ in range(2):  # the engine and its restart: vLLM's server socket sets SO_REUSEADDR
            with socket.socket() as server:
                server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                server.bind(("127.0.0.1", port))
                server.listen()
    run.stop_all()
    for port in ports:
        with socket.socket() as other:
            other.bind(("127.0.0.1", port))  # released with the run


def _role_exiting(run: LocalRun, name: str, code: int, message: str) -> None:
    """A role process that writes `message` to its termination log and exits with `code`."""
    import sys

    script = f"import os, sys; open(os.environ['KUBERL_TERMINATION_LOG'], 'w').write({message!r}); sys.exit({code})"
    for role in run.roles:
        if role.name == name:
            role.argv = [sys.executable, "-c", script]
            role.start()
            role.proc.wait(timeout=30)


def test_a_role_that_exits_2_stops_the_run_with_its_reason_and_is_not_restarted(tmp_path):
    exp = make_experiment(rollout={"engine": "vllm", "replicas": 1, "accelerator": {"type": "cpu", "count": 0}},
                          trainer={"accelerator": {"type": "cpu", "count": 1}}, failurePolicy={"maxRestarts": 3})
    run = LocalRun(exp, tmp_path / "e.yaml", tmp_path, "nats://127.0.0.1:1")
    run.plan(gpus=0)
    _role_exiting(run, "rollout-0", 2, "dataset.path: '/data/x.jsonl' does not exist\n")
    failure = run.supervise()
    assert failure is not None and run.config_error
    assert "rollout-0 stopped on a configuration error (exit 2): dataset.path: '/data/x.jsonl' does not exist" in failure
    assert next(r for r in run.roles if r.name == "rollout-0").restarts == 0


def test_a_role_that_exits_1_is_restarted_under_the_failure_policy(tmp_path):
    exp = make_experiment(rollout={"engine": "vllm", "replicas": 1, "accelerator": {"type": "cpu", "count": 0}},
                          trainer={"accelerator": {"type": "cpu", "count": 1}}, failurePolicy={"maxRestarts": 3})
    run = LocalRun(exp, tmp_path / "e.yaml", tmp_path, "nats://127.0.0.1:1")
    run.plan(gpus=0)
    _role_exiting(run, "trainer", 1, "")
    assert run.supervise() is None and not run.config_error
    assert run.trainer.next_start > 0  # a restart is scheduled after the backoff


def test_the_reward_plot_is_a_png_and_needs_metrics(tmp_path):
    assert plot_rewards(tmp_path / "metrics.jsonl", tmp_path / "r.png") is None
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward_mean": i / 10}) + "\n" for i in range(1, 11)))
    out = plot_rewards(tmp_path / "metrics.jsonl", tmp_path / "r.png")
    assert out is not None and out.read_bytes()[:4] == b"\x89PNG"
