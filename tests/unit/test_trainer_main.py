"""`kuberl trainer`: arguments and environment; bad input gives exit code 2 and a message naming it."""

from __future__ import annotations

import pytest
import yaml

from kuberl.cli import main as cli_main
from kuberl.runtime.trainer.main import resolve_bus_url, resolve_workdir


def manifest(tmp_path, bus: dict | None = None):
    doc = {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "m"},
           "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}, "training": {"totalSteps": 1}}}
    if bus is not None:
        doc["spec"]["bus"] = bus
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_bus_url_comes_from_the_flag_then_the_environment_then_an_external_bus(tmp_path, monkeypatch):
    from kuberl.api import load_experiment

    exp = load_experiment(manifest(tmp_path, {"external": {"url": "nats://ext:4222"}}))
    monkeypatch.setenv("KUBERL_BUS_URL", "nats://env:4222")
    assert resolve_bus_url(exp, "nats://flag:4222") == "nats://flag:4222"
    assert resolve_bus_url(exp, None) == "nats://env:4222"
    monkeypatch.delenv("KUBERL_BUS_URL")
    assert resolve_bus_url(exp, None) == "nats://ext:4222"


def test_an_embedded_bus_without_a_url_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KUBERL_BUS_URL", raising=False)
    assert cli_main(["trainer", "--config", str(manifest(tmp_path)), "--workdir", str(tmp_path)]) == 2
    assert "bus URL: pass --bus-url, set $KUBERL_BUS_URL" in capsys.readouterr().err


def test_a_missing_workdir_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KUBERL_WORKDIR", raising=False)
    assert cli_main(["trainer", "--config", str(manifest(tmp_path)), "--bus-url", "nats://x:4222"]) == 2
    assert "workdir: pass --workdir or set $KUBERL_WORKDIR" in capsys.readouterr().err
    monkeypatch.setenv("KUBERL_WORKDIR", "/w")
    assert resolve_workdir(None) == "/w"


def test_an_invalid_manifest_names_the_field(tmp_path, capsys):
    path = manifest(tmp_path)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["algorithm"] = {"batchSize": 0}
    path.write_text(yaml.safe_dump(doc))
    assert cli_main(["trainer", "--config", str(path), "--bus-url", "nats://x:4222", "--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "spec.algorithm.batchSize" in err and "greater than or equal to 1" in err


def test_a_missing_manifest_is_named(tmp_path, capsys):
    assert cli_main(["trainer", "--config", str(tmp_path / "nope.yaml"), "--bus-url", "nats://x:4222", "--workdir", str(tmp_path)]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_torchrun_environment_is_read_and_checked(monkeypatch):
    from kuberl.runtime.trainer import dist

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"\$RANK=3 and \$WORLD_SIZE=2"):
        dist.init_distributed()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match=r"\$RANK: 'x' is not an integer"):
        dist.init_distributed()


def test_a_backend_this_trainer_cannot_run_exits_2_with_the_reason_as_termination_message(tmp_path):
    """contracts.md: exit code 2 and a one-line reason in $KUBERL_TERMINATION_LOG; the pod's podFailurePolicy
    and the operator read these, so neither the Job nor `kuberl run` retries it."""
    import os
    import subprocess
    import sys

    path = manifest(tmp_path)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["trainer"] = {"backend": "megatron", "parallelism": {"context": 2, "expert": 2}}
    path.write_text(yaml.safe_dump(doc))
    log = tmp_path / "termination-log"
    env = {**os.environ, "KUBERL_TERMINATION_LOG": str(log)}
    proc = subprocess.run([sys.executable, "-m", "kuberl.cli", "trainer", "--config", str(path), "--bus-url", "nats://127.0.0.1:1",
                           "--workdir", str(tmp_path / "work")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    message = log.read_text()
    # Admission refuses megatron's context parallel of a MoE model (not implemented); a trainer handed such a file refuses it the same way on load.
    from kuberl.api.v1alpha1 import MEGATRON_CONTEXT_EXPERT

    assert MEGATRON_CONTEXT_EXPERT in message
    assert message.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "configuration error: " in proc.stderr and MEGATRON_CONTEXT_EXPERT in proc.stderr


def test_the_trainer_still_refuses_a_backend_it_cannot_run_that_slipped_past_validation(tmp_path):
    """Second line of defence behind admission: a spec changed after validation (megatron with LoRA adapters,
    which only the fsdp trainer trains) still gets the trainer's own refusal, not a run without the adapters."""
    from kuberl.api import load_experiment
    from kuberl.api.algorithm import LoRASpec
    from kuberl.runtime.errors import ConfigError
    from kuberl.runtime.trainer.trainer import Trainer

    exp = load_experiment(manifest(tmp_path))
    exp.spec.trainer.backend = "megatron"  # no validation on assignment: what admission would have refused
    exp.spec.algorithm.lora = LoRASpec(rank=8, alpha=16)
    with pytest.raises(ConfigError, match=r"^algorithm.lora: LoRA adapters are trained by trainer.backend fsdp only; remove algorithm.lora or use fsdp$"):
        Trainer(exp, bus_url="nats://127.0.0.1:1", workdir=tmp_path / "work")
