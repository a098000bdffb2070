"""`kuberl render`'s output is what a real API server accepts: every example's objects pass a server-side dry run
(schema, defaulting, admission plugins: what `kubectl apply` of the rendered YAML would meet), so a platform engineer
who reviews or scans the rendered YAML reviews objects that apply. (Admission of the examples themselves, which
`kuberl render` checks first, is tested in test_admission_parity and tests/unit/test_examples.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kuberl.api.validation import load_documents
from kuberl.operator.render import render
from kuberl.testing.examples import experiment_files

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
NS = "render-check"


def test_every_examples_rendered_objects_pass_a_server_side_dry_run(kube) -> None:
    objects = [obj for example in experiment_files() for doc in load_documents(str(example))
               if doc.get("kind") == "RLExperiment" for obj in render(doc, NS)]
    kube.run("kubectl", "create", "namespace", NS, check=False)
    applied = kube.run("kubectl", "apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump_all(objects), check=False, timeout=240)
    assert applied.returncode == 0, applied.stderr[-4000:]
    lines = [line for line in applied.stdout.splitlines() if line.strip()]
    assert len(lines) == len(objects) and all(line.endswith("(server dry run)") for line in lines), applied.stdout[-2000:]
