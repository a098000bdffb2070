"""`kuberl validate`: the invalid corpus fails with its expected message, every example passes."""

from __future__ import annotations

import argparse
import copy
import subprocess
import sys
from pathlib import Path

import pytest

from kuberl.api import validation
from kuberl.api.validation import ValidationError, validate_manifest
from kuberl.testing.examples import experiment_files

ROOT = Path(__file__).resolve().parents[2]
INVALID = sorted((ROOT / "tests" / "invalid").glob("*.yaml"))
EXAMPLES = experiment_files()


def expected_message(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name}: the first line must be `# expect: <message>`"
    return first.removeprefix("# expect: ")


def run_cli(*files: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kuberl.cli", "validate", *map(str, files)],
        check=False, capture_output=True, text=True, cwd=ROOT, timeout=120,
    )


def minimal(**spec) -> dict:
    doc = {
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "ok"},
        "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "add-small"}},
    }
    doc["spec"].update(spec)
    return doc


def test_the_corpus_covers_at_least_thirty_invalid_manifests():
    assert len(INVALID) >= 30
    assert all(expected_message(p) for p in INVALID)


def test_the_real_cli_rejects_every_invalid_manifest_with_its_message():
    result = run_cli(*INVALID)
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout + result.stderr
    for path in INVALID:
        lines = [line for line in out.splitlines() if str(path) in line]
        assert f"OK {path}" not in out, f"{path.name} passed validation"
        want = expected_message(path)
        assert any(want in line for line in lines), f"{path.name}: expected {want!r} in:\n" + "\n".join(lines)


@pytest.mark.parametrize("path", INVALID, ids=[p.stem for p in INVALID])
def test_each_invalid_manifest_fails_alone_with_its_message(path, capsys):
    assert validation.main(argparse.Namespace(files=[str(path)])) == 1
    out = capsys.readouterr().out
    assert expected_message(path) in out
    assert not out.startswith("OK ")


def test_the_real_cli_passes_every_example():
    assert len(EXAMPLES) >= 10
    result = run_cli(*EXAMPLES)
    assert result.returncode == 0, result.stdout + result.stderr
    for path in EXAMPLES:
        assert f"OK {path}" in result.stdout


def test_every_example_says_what_it_needs_in_its_header():
    for path in EXAMPLES:
        header = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
        assert "Needs" in header or path.name == "quickstart.yaml", f"{path.name}: header must say what it needs"


def test_other_kinds_are_skipped_with_a_note(tmp_path):
    f = tmp_path / "mixed.yaml"
    f.write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: cfg}\n---\n"
        "apiVersion: kuberl.io/v1alpha1\nkind: RLExperiment\nmetadata: {name: ok}\n"
        "spec: {model: {builtin: tiny-qwen2}, dataset: {builtin: add-small}}\n"
    )
    result = run_cli(f)
    assert result.returncode == 0, result.stdout
    assert "skipping ConfigMap 'cfg'" in result.stdout and f"OK {f}" in result.stdout


def test_a_missing_file_is_an_error_naming_it(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert validation.main(argparse.Namespace(files=[str(missing)])) == 1
    assert "nope.yaml" in capsys.readouterr().out


def test_errors_carry_path_value_and_message():
    errors = validate_manifest(minimal(algorithm={"temperature": 3}))
    assert errors == [ValidationError("spec.algorithm.temperature", 3, "spec.algorithm.temperature in body should be less than or equal to 2")]


def test_several_problems_are_reported_together():
    errors = validate_manifest(minimal(algorithm={"temperature": 3, "name": "x"}, foo=1))
    assert {e.path for e in errors} == {"spec.foo", "spec.algorithm.temperature", "spec.algorithm.name"}


def test_validation_does_not_mutate_the_manifest():
    doc = minimal()
    before = copy.deepcopy(doc)
    assert validate_manifest(doc) == []
    assert doc == before


def test_generate_name_is_accepted_like_the_api_server_does():
    doc = minimal()
    doc["metadata"] = {"generateName": "sweep-"}
    assert validate_manifest(doc) == []


def test_status_is_ignored_because_the_status_subresource_drops_it_on_create():
    doc = minimal()
    doc["status"] = {"phase": "NotAPhase"}
    assert validate_manifest(doc) == []


def test_tolerations_and_affinity_follow_core_v1_and_metadata_is_free():
    # B8: tolerations and affinity carry the core/v1 schemas, so a typo is named at admission.
    doc = minimal(rollout={"tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                           "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                               {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}]}}}})
    doc["metadata"]["labels"] = {"team": "rl"}
    doc["metadata"]["annotations"] = {"note": "x"}
    assert validate_manifest(doc) == []
    doc["spec"]["rollout"]["affinity"] = {"nodeAffinity": {"anything": True}}
    assert [e.path for e in validate_manifest(doc)] == ["spec.rollout.affinity.nodeAffinity.anything"]


def test_api_server_defaults_never_contradict_the_allocation_shorthand():
    # The operator sees the object after defaulting: a defaulted replicas=1 would contradict d4.
    assert validate_manifest(minimal(allocation="sglang:d4+fsdp:d4")) == []
    assert validate_manifest(minimal(allocation="vllm:d2t2+fsdp:d16")) == []


def test_integers_in_number_fields_are_fine():
    assert validate_manifest(minimal(algorithm={"epsClip": 1, "epsClipHigh": 2, "temperature": 1})) == []
