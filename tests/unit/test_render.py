"""`kuberl render`: the operator's objects for a manifest, printed for review (issue #38 point 7). The server-side
check of the same output is tests/integration/test_render_on_server.py."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import yaml

from kuberl.api import load_experiments
from kuberl.operator.builders import build_children
from kuberl.operator.render import PLACEHOLDER, STAND_IN
from kuberl.testing.examples import experiment_files

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = experiment_files()


def render(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`kuberl render ARGS` in this process (the CLI's own parser and main), its output and exit code captured."""
    import contextlib
    import io
    import os
    from unittest import mock

    from kuberl.cli import build_parser
    from kuberl.operator import render as R

    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, env or {}), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = R.main(build_parser().parse_args(["render", *args]))
        finally:
            R.configure("", "")  # back to the defaults for the next test
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_the_cli_runs_render() -> None:
    out = subprocess.run([sys.executable, "-m", "kuberl.cli", "render", "examples/quickstart-cpu.yaml"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120, check=False)
    assert out.returncode == 0 and "kind: StatefulSet" in out.stdout, out.stderr


def objects(out: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(out) if d]


def test_the_quickstart_renders_what_the_builders_build_with_every_secret_value_withheld() -> None:
    out = render("examples/quickstart-cpu.yaml")
    assert out.returncode == 0, out.stderr
    got = objects(out.stdout)
    exp = load_experiments(ROOT / "examples/quickstart-cpu.yaml")[0]
    exp.metadata.namespace = exp.metadata.namespace or "default"
    built = build_children(exp, bus_token="x", engine_api_key="y")
    assert [(o["kind"], o["metadata"]["name"]) for o in got] == [(o["kind"], o["metadata"]["name"]) for o in built]
    assert all(o["metadata"]["namespace"] == "default" for o in got)
    secrets = [o for o in got if o["kind"] == "Secret"]
    values = [base64.b64decode(v).decode() for s in secrets for v in s.get("data", {}).values()]
    values += [v for s in secrets for v in s.get("stringData", {}).values()]
    assert len(secrets) == 2 and len(values) >= 6 and set(values) == {PLACEHOLDER}, values
    assert STAND_IN not in out.stdout  # not even a value derived in plain text from the stand-in token
    assert out.stdout.startswith("# Rendered by `kuberl render`")


def test_every_example_renders() -> None:
    """render() of each example (admission, which main() runs first, is tested on every example by test_examples)."""
    from kuberl.api.validation import load_documents
    from kuberl.operator.render import render as render_doc

    for example in EXAMPLES:
        for doc in (d for d in load_documents(str(example)) if d.get("kind") == "RLExperiment"):
            got = render_doc(doc, "team-a")
            kinds = {o["kind"] for o in got}
            assert {"ConfigMap", "StatefulSet", "Job"} <= kinds, (example.name, kinds)
            assert all(o["metadata"]["namespace"] == "team-a" for o in got), example.name


def test_a_manifest_admission_refuses_prints_its_errors_and_no_objects(tmp_path: Path) -> None:
    doc = yaml.safe_load((ROOT / "examples/quickstart-cpu.yaml").read_text())
    doc["spec"]["algorithm"] = {**doc["spec"].get("algorithm", {}), "samplesPerPrompt": 0}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    out = render(str(bad))
    assert out.returncode == 1 and out.stdout == ""
    assert "samplesPerPrompt" in out.stderr


def test_the_operators_image_settings_apply_from_flags_or_its_environment() -> None:
    def images(out: str) -> set[str]:
        return {c["image"] for o in objects(out) if o["kind"] in ("StatefulSet", "Job")
                for c in o["spec"]["template"]["spec"]["containers"]}

    by_env = render("examples/quickstart-cpu.yaml", env={"KUBERL_NATS_IMAGE": "mirror.example.com/nats:2.15-alpine",
                                                          "KUBERL_RUNTIME_IMAGE_REPOSITORY": "mirror.example.com/kuberl"})
    assert "mirror.example.com/nats:2.15-alpine" in images(by_env.stdout)
    assert all(i.startswith("mirror.example.com/") for i in images(by_env.stdout)), images(by_env.stdout)
    by_flag = render("examples/quickstart-cpu.yaml", "--nats-image", "other.example.com/nats:2.15")
    assert "other.example.com/nats:2.15" in images(by_flag.stdout)
    bad = render("examples/quickstart-cpu.yaml", "--nats-image", "not a reference")
    assert bad.returncode == 2 and "NATS image" in bad.stderr


def test_a_queued_experiment_renders_its_kueue_workload_first(tmp_path: Path) -> None:
    doc = yaml.safe_load((ROOT / "examples/quickstart-cpu.yaml").read_text())
    doc["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    queued = tmp_path / "queued.yaml"
    queued.write_text(yaml.safe_dump(doc))
    got = objects(render(str(queued)).stdout)
    assert got[0]["kind"] == "Workload" and got[0]["spec"]["queueName"] == "team-a"
