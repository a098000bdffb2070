"""kuberl.runtime.errors: what counts as a configuration error, and how it reaches the termination message."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kuberl.runtime import errors as E
from kuberl.runtime.trainer.torchrun import exit_code


class TestSpecErrors:
    def test_a_value_or_file_error_from_set_up_becomes_a_config_error_naming_the_field(self):
        with pytest.raises(E.ConfigError, match="model.path: '/models/m/qwen' is not a folder"):
            with E.spec_errors():
                raise ValueError("model.path: '/models/m/qwen' is not a folder")
        with pytest.raises(E.ConfigError, match="no such file"):
            with E.spec_errors():
                raise FileNotFoundError("no such file")

    def test_a_network_problem_behind_a_value_error_stays_retryable(self):
        class LocalEntryNotFoundError(Exception):  # huggingface_hub's, matched by name
            pass

        for cause in (LocalEntryNotFoundError("offline"), ConnectionError("refused"), TimeoutError()):
            with pytest.raises(ValueError) as info:
                with E.spec_errors():
                    try:
                        raise cause
                    except Exception as exc:
                        raise ValueError("model.id: cannot download") from exc
            assert not isinstance(info.value, E.ConfigError)

    def test_an_http_5xx_or_429_is_transient_a_404_is_not(self):
        def http(status: int) -> Exception:
            exc = RuntimeError("hub")
            exc.response = SimpleNamespace(status_code=status)  # type: ignore[attr-defined]
            return exc

        assert E.is_transient(http(503)) and E.is_transient(http(429))
        assert not E.is_transient(http(404)) and not E.is_transient(ValueError("x"))

    def test_other_errors_pass_through_unchanged(self):
        with pytest.raises(RuntimeError):
            with E.spec_errors():
                raise RuntimeError("CUDA out of memory")


class TestTerminationMessage:
    def test_secrets_from_the_environment_and_url_credentials_are_redacted(self, monkeypatch):
        monkeypatch.setenv("KUBERL_BUS_TOKEN", "tok-0123456789")
        message = E.redact("connect nats://user:pa55word@bus:4222 with tok-0123456789 failed")
        assert "tok-0123456789" not in message and "pa55word" not in message
        assert message == "connect nats://***@bus:4222 with *** failed"

    def test_the_message_is_one_line_and_short_enough_for_the_kubelet(self):
        assert E.redact("1 validation error\nspec.x\n   must be > 0\n") == "1 validation error; spec.x; must be > 0"
        assert len(E.redact("x" * 10_000).encode()) <= E.MAX_MESSAGE_BYTES

    def test_the_reason_goes_to_the_file_the_environment_names_and_the_exit_code_is_2(self, tmp_path, monkeypatch, capsys):
        monkeypatch.setenv(E.TERMINATION_LOG_ENV, str(tmp_path / "term"))
        assert E.config_error_exit("rollout", E.ConfigError("dataset.promptField: row 0 has no field 'q'")) == 2
        assert (tmp_path / "term").read_text() == "dataset.promptField: row 0 has no field 'q'\n"
        assert "kuberl rollout: configuration error: dataset.promptField" in capsys.readouterr().err

    def test_outside_a_container_without_the_variable_nothing_is_written(self, monkeypatch):
        monkeypatch.delenv(E.TERMINATION_LOG_ENV, raising=False)
        monkeypatch.setattr(E, "DEFAULT_TERMINATION_LOG", "/nonexistent-dir/termination-log")
        assert E.termination_log_path() is None and E.write_termination_message("x") is None


def test_the_torchrun_wrapper_passes_the_first_failed_ranks_exit_code_2_on():
    failures = {0: SimpleNamespace(exitcode=2), 1: SimpleNamespace(exitcode=-15)}
    assert exit_code(failures, first_rank=0) == 2
    assert exit_code(failures, first_rank=1) == 1
    assert exit_code({0: SimpleNamespace(exitcode=1)}, first_rank=0) == 1


@pytest.mark.parametrize("role", ["rollout", "engine"])
def test_the_rollout_pods_roles_exit_2_with_the_reason_when_the_model_is_not_on_the_volume(tmp_path, role):
    """What the operator reads from lastState.terminated of the engine and rollout-agent containers."""
    import os
    import subprocess
    import sys

    import yaml

    missing = tmp_path / "models" / "qwen"
    doc = {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "m"},
           "spec": {"model": {"path": str(missing)}, "dataset": {"builtin": "repeat-digit"},
                    "rollout": {"engine": "vllm", "accelerator": {"type": "cpu", "count": 0}}}}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(doc))
    log = tmp_path / "termination-log"
    env = {**os.environ, E.TERMINATION_LOG_ENV: str(log)}
    env.pop("KUBERL_ENGINE_URL", None)
    proc = subprocess.run([sys.executable, "-m", "kuberl.cli", role, "--config", str(tmp_path / "m.yaml"), "--bus-url", "nats://127.0.0.1:1",
                           "--workdir", str(tmp_path / "work")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert log.read_text() == f"model.path: {str(missing)!r} is not a folder\n"
