"""`kuberl run`'s main without starting a role: the spec checks before anything starts, and the outcome's
exit code and lines (the full run: tests/integration/test_run.py)."""

from __future__ import annotations

import argparse
import types
from pathlib import Path

import pytest
import yaml

from kuberl.runtime import launcher
from kuberl.runtime.errors import CONFIG_ERROR_EXIT, ConfigError


def args_for(path: Path, workdir: Path) -> argparse.Namespace:
    return argparse.Namespace(file=str(path), workdir=str(workdir), resume=False, max_steps=None, bus_url=None)


def manifest(tmp_path: Path) -> Path:
    doc = {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "t"},
           "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}, "training": {"totalSteps": 3}}}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_an_invalid_manifest_exits_2_naming_the_file_and_creates_no_workdir(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: kuberl.io/v1alpha1\nkind: RLExperiment\nmetadata: {name: t}\nspec: {training: {totalSteps: -1}}\n")
    assert launcher.main(args_for(bad, tmp_path / "work")) == 2
    assert f"kuberl run: {bad} is not a valid RLExperiment" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_a_model_that_cannot_be_built_exits_with_the_configuration_error_code_before_the_bus_starts(tmp_path, monkeypatch, capsys):
    def refuse(model, workdir):
        raise ConfigError("model.builtin: no such model")

    def no_bus(*a, **kw):
        raise AssertionError("the bus must not start for a spec that cannot run")

    monkeypatch.setattr("kuberl.runtime.models.resolve_model", refuse)
    monkeypatch.setattr(launcher, "_start_bus", no_bus)
    workdir = tmp_path / "work"
    assert launcher.main(args_for(manifest(tmp_path), workdir)) == CONFIG_ERROR_EXIT
    err = capsys.readouterr().err
    assert "kuberl run: configuration error:" in err and "model.builtin: no such model" in err
    assert (workdir / "experiment.yaml").exists(), "the run's manifest is written before the model is built"


def test_the_bus_is_the_given_url_then_the_specs_external_one(tmp_path):
    exp = launcher.load_experiment(manifest(tmp_path))
    given = argparse.Namespace(bus_url="nats://given:4222")
    assert launcher._start_bus(given, exp, tmp_path) == (None, "nats://given:4222")
    external = exp.model_copy(update={"spec": exp.spec.model_copy(update={"bus": exp.spec.bus.model_copy(
        update={"external": types.SimpleNamespace(url="nats://external:4222")})})})
    assert launcher._start_bus(argparse.Namespace(bus_url=None), external, tmp_path) == (None, "nats://external:4222")


@pytest.mark.parametrize("report, failure, interrupted, config_error, code", [
    ({"step": 3, "total_steps": 3, "done": True}, None, False, None, 0),
    ({"step": 2, "total_steps": 3, "failed": "CUDA out of memory"}, None, False, None, 1),
    (None, "engine-0 stopped", False, None, 1),
    (None, "trainer stopped on a configuration error", False, "trainer", CONFIG_ERROR_EXIT),
    ({"step": 1, "total_steps": 3}, None, True, None, 130),
    ({"step": 1, "total_steps": 3}, "bus gone", True, None, 1),  # a failure wins over the interrupt
])
def test_the_outcome_sets_the_exit_code(tmp_path, capsys, report, failure, interrupted, config_error, code):
    run = types.SimpleNamespace(config_error=config_error)
    assert launcher._finish(run, tmp_path, report, failure, interrupted) == code
    out, err = capsys.readouterr()
    if report:
        assert f"kuberl run: step {report['step']}/{report['total_steps']}" in out
    if failure:
        assert f"kuberl run: failed: {failure}" in err
    elif report and report.get("failed"):
        assert f"kuberl run: trainer failed: {report['failed']}" in err


def test_the_outcome_prints_the_evaluation_and_the_plot(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {i}, "reward_mean": {i / 10}}}\n' for i in range(1, 6)))
    report = {"step": 5, "total_steps": 5, "policy_version": 5, "reward_mean": 0.5, "done": True,
              "eval": {"step": 5, "policy_version": 5, "items": 8, "reward_mean": 0.5, "greedy_reward_mean": 0.625,
                       "pass_at_1_greedy": 0.5, "pass_at_k": {"2": 0.75}}}
    assert launcher._finish(types.SimpleNamespace(config_error=None), tmp_path, report, None, False) == 0
    out = capsys.readouterr().out
    assert "policy version 5, last reward 0.5" in out
    assert (tmp_path / "reward.png").exists() and f"reward curve in {tmp_path / 'reward.png'}" in out
    assert "kuberl run: eval (step 5, v5, 8 items): reward 0.5 greedy 0.625 pass@1 greedy 0.5 pass@2 0.75" in out


def test_an_interrupted_run_is_not_plotted_but_names_the_command_that_plots_it(tmp_path, capsys):
    """Drawing takes seconds on a busy machine; a stop has to end within its bound."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.1}\n')
    report = {"step": 1, "total_steps": 5, "policy_version": 1, "reward_mean": 0.1}
    assert launcher._finish(types.SimpleNamespace(config_error=None), tmp_path, report, None, True) == 130
    out = capsys.readouterr().out
    assert not (tmp_path / "reward.png").exists()
    assert f"draw them with `kuberl plot {tmp_path}`" in out
