"""The Argo CD Applications in examples/argocd, admitted by a real kube-apiserver serving the upstream Application CRD
(tests/fixtures/argocd/upstream): each is created with dryRun=All and fieldValidation=Strict, as `kubectl apply
--validate=strict` sends it, so an unknown field (a typo), a wrong type or a missing required field is refused by the
server's own structural-schema checks. The Lua health checks and actions are tested in tests/unit/test_argocd.py.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kuberl.testing.control_plane import crd_established

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[2]
ARGOCD = ROOT / "examples" / "argocd"
CRD = ROOT / "tests" / "fixtures" / "argocd" / "upstream" / "application-crd.yaml"
APPLICATIONS = ["application.yaml", "operator-application.yaml"]


@pytest.fixture(scope="module")
def argocd(kube: Any) -> Iterator[Any]:
    """The upstream Application CRD, Established, and the `argocd` namespace the Applications live in."""
    kube.run("kubectl", "apply", "--server-side", "-f", str(CRD))
    # Polled: `kubectl wait --for=condition=Established` fails at once on a CRD whose status is not written yet.
    deadline = time.monotonic() + 60
    while not crd_established(lambda *args, check: kube.run("kubectl", *args, check=check), "applications.argoproj.io"):
        assert time.monotonic() < deadline, "the Application CRD is not Established after 60 s"
        time.sleep(0.3)
    made = kube.run("kubectl", "create", "namespace", "argocd", check=False)
    assert made.returncode == 0 or "AlreadyExists" in made.stderr, made.stderr
    yield kube
    kube.run("kubectl", "delete", "-f", str(CRD), "--wait=false", check=False)


def admit(kube: Any, app: dict[str, Any]) -> tuple[bool, str]:
    """(admitted, the server's answer) for creating `app` with dryRun=All and fieldValidation=Strict."""
    out = kube.run("kubectl", "create", "--dry-run=server", "--validate=strict", "-o", "json", "-f", "-",
                   stdin=json.dumps(app), check=False)
    return out.returncode == 0, out.stderr


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((ARGOCD / name).read_text())


@pytest.mark.parametrize("name", APPLICATIONS)
def test_the_application_is_admitted_by_the_upstream_crd(argocd: Any, name: str) -> None:
    ok, why = admit(argocd, load(name))
    assert ok, why


@pytest.mark.parametrize(("where", "typo"), [
    (("spec",), "syncPolcy"),
    (("spec", "syncPolicy", "automated"), "selfheal"),
    (("spec", "source"), "targetRevison"),
    (("spec", "ignoreDifferences", 0), "jsonPointer"),
])
def test_a_typo_is_refused_naming_the_field(argocd: Any, where: tuple[Any, ...], typo: str) -> None:
    app = copy.deepcopy(load("application.yaml"))
    node = app
    for part in where:
        node = node[part]
    node[typo] = True
    ok, why = admit(argocd, app)
    assert not ok and "unknown field" in why and typo in why, why


def test_a_wrong_type_and_a_missing_required_field_are_refused(argocd: Any) -> None:
    app = load("application.yaml")
    app["spec"]["syncPolicy"]["automated"]["prune"] = "false"
    del app["spec"]["destination"]
    ok, why = admit(argocd, app)
    assert not ok, why
    assert "spec.syncPolicy.automated.prune" in why and "boolean" in why, why
    assert "spec.destination" in why and "Required value" in why, why
