"""The Argo CD integration in examples/argocd: the RLExperiment health check and the suspend/resume
actions, run through Lua 5.1 (lupa; Argo CD's gopher-lua is 5.1) on realistic objects from
tests/fixtures/argocd (each checked against the API models), plus the argocd-cm snippet and the
Applications."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

lua51 = pytest.importorskip("lupa.lua51", reason="lupa is in kuberl[test]")

from kuberl.api import RLExperiment, load_experiment

ROOT = Path(__file__).resolve().parents[2]
ARGOCD = ROOT / "examples" / "argocd"
FIXTURES = ROOT / "tests" / "fixtures" / "argocd"
ARGO_HEALTH = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}


def fixture(name: str) -> dict:
    return yaml.safe_load((FIXTURES / f"{name}.yaml").read_text())


def to_python(value):
    """A Lua table back to dicts/lists (a table with keys 1..n is a list)."""
    if lua51.lua_type(value) != "table":
        return value
    items = dict(value.items())
    if items and all(isinstance(k, int) for k in items) and sorted(items) == list(range(1, len(items) + 1)):
        return [to_python(items[i]) for i in range(1, len(items) + 1)]
    return {k: to_python(v) for k, v in items.items()}


def run_lua(script: Path, obj: dict):
    """Run a script as Argo CD does: `obj` is a global, the script's return value is the answer.
    The libraries Argo CD withholds (os, io, require...) are removed, so using one fails here too."""
    lua = lua51.LuaRuntime(unpack_returned_tuples=True)
    for name in ("os", "io", "require", "dofile", "loadfile", "package", "debug"):
        lua.globals()[name] = None
    lua.globals()["obj"] = lua.table_from(copy.deepcopy(obj), recursive=True)
    fn = lua.execute(f"return function() {script.read_text()}\nend")
    return to_python(fn())


def health(obj: dict) -> dict:
    return run_lua(ARGOCD / "health.lua", obj)


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_fixture_is_a_valid_rlexperiment_with_a_status_the_models_accept(path):
    RLExperiment.model_validate(yaml.safe_load(path.read_text()))


CASES = {
    # fixture: (Argo CD status, words the message must contain)
    "pending-without-status": ("Progressing", "operator"),
    "initializing": ("Progressing", "0/2 rollout replicas"),
    "running-ready": ("Healthy", "step 42/150, reward 0.612"),
    "running-not-ready": ("Progressing", "engines loading weights"),
    "running-degraded": ("Degraded", "CrashLoopBackOff"),
    "failed": ("Degraded", "maxRestarts 3"),
    "suspended": ("Suspended", "checkpoint step 60 saved"),
    "succeeded": ("Healthy", "step 150/150"),
    "spec-change-not-reconciled": ("Progressing", "generation 3"),
    "validation-failed": ("Degraded", "tensorParallelSize"),
}


def test_every_fixture_has_an_expected_health():
    assert {p.stem for p in FIXTURES.glob("*.yaml")} == set(CASES)


@pytest.mark.parametrize("name,expected", CASES.items(), ids=CASES.keys())
def test_health_of_each_status_dump(name, expected):
    status, words = expected
    result = health(fixture(name))
    assert result["status"] == status, result
    assert words in result["message"], result


class TestHealthRules:
    def test_the_failed_condition_wins_over_a_running_phase(self):
        obj = fixture("running-ready")
        obj["status"]["conditions"].append({"type": "Failed", "status": "True", "reason": "BusLost", "message": "bus unreachable"})
        assert health(obj) == {"status": "Degraded", "message": "bus unreachable (step 42/150, reward 0.612)"}

    def test_a_degraded_condition_that_is_false_does_not_degrade(self):
        obj = fixture("running-ready")
        obj["status"]["conditions"].append({"type": "Degraded", "status": "False", "reason": "AllReplicasReady"})
        assert health(obj)["status"] == "Healthy"

    def test_running_without_any_ready_condition_is_progressing(self):
        obj = fixture("running-ready")
        obj["status"]["conditions"] = [c for c in obj["status"]["conditions"] if c["type"] != "Ready"]
        assert health(obj)["status"] == "Progressing"

    def test_a_message_falls_back_to_the_reason(self):
        obj = fixture("failed")
        for c in obj["status"]["conditions"]:
            c["message"] = ""
        assert health(obj)["message"].startswith("MaxRestartsExceeded")

    def test_an_unknown_phase_is_unknown_not_healthy(self):
        obj = fixture("running-ready")
        obj["status"]["phase"] = "Exploding"
        assert health(obj) == {"status": "Unknown", "message": "Unknown phase Exploding"}

    @pytest.mark.parametrize("name", CASES)
    def test_answers_only_statuses_argo_cd_knows(self, name):
        assert health(fixture(name))["status"] in ARGO_HEALTH


class TestActions:
    def test_discovery_offers_suspend_to_a_running_experiment(self):
        actions = run_lua(ARGOCD / "actions" / "discovery.lua", fixture("running-ready"))
        assert actions["suspend"]["disabled"] is False
        assert actions["resume"]["disabled"] is True

    def test_discovery_offers_resume_to_a_suspended_experiment(self):
        actions = run_lua(ARGOCD / "actions" / "discovery.lua", fixture("suspended"))
        assert (actions["suspend"]["disabled"], actions["resume"]["disabled"]) == (True, False)

    @pytest.mark.parametrize("name", ["succeeded", "failed"])
    def test_discovery_offers_nothing_for_a_finished_experiment(self, name):
        actions = run_lua(ARGOCD / "actions" / "discovery.lua", fixture(name))
        assert actions["suspend"]["disabled"] and actions["resume"]["disabled"]

    @pytest.mark.parametrize("action,start,value", [("suspend", "running-ready", True), ("resume", "suspended", False)])
    def test_action_sets_spec_suspend_and_changes_nothing_else(self, action, start, value):
        before = fixture(start)
        after = run_lua(ARGOCD / "actions" / action / "action.lua", before)
        assert after["spec"]["suspend"] is value
        expected = copy.deepcopy(before)
        expected["spec"]["suspend"] = value
        assert after == expected
        RLExperiment.model_validate(after)


class TestArgoCDConfigMap:
    def data(self) -> dict:
        cm = yaml.safe_load((ARGOCD / "argocd-cm.yaml").read_text())
        assert (cm["kind"], cm["metadata"]["name"]) == ("ConfigMap", "argocd-cm")
        return cm["data"]

    def test_health_script_is_a_copy_of_health_lua(self):
        assert self.data()["resource.customizations.health.kuberl.io_RLExperiment"] == (ARGOCD / "health.lua").read_text()

    def test_actions_are_copies_of_the_action_files(self):
        actions = yaml.safe_load(self.data()["resource.customizations.actions.kuberl.io_RLExperiment"])
        assert actions["discovery.lua"] == (ARGOCD / "actions" / "discovery.lua").read_text()
        defs = {d["name"]: d["action.lua"] for d in actions["definitions"]}
        assert defs == {n: (ARGOCD / "actions" / n / "action.lua").read_text() for n in ("suspend", "resume")}

    def test_discovery_names_exactly_the_defined_actions(self):
        offered = run_lua(ARGOCD / "actions" / "discovery.lua", fixture("running-ready"))
        assert set(offered) == {p.name for p in (ARGOCD / "actions").iterdir() if p.is_dir()}


class TestApplications:
    def test_experiment_application_syncs_a_valid_experiment_from_this_repository(self):
        app = yaml.safe_load((ARGOCD / "application.yaml").read_text())
        assert (app["apiVersion"], app["kind"]) == ("argoproj.io/v1alpha1", "Application")
        src = app["spec"]["source"]
        manifest = ROOT / src["path"] / src["directory"]["include"]
        assert manifest.exists(), manifest
        load_experiment(manifest)

    def test_fields_others_change_at_run_time_are_ignored_and_exist_in_the_crd(self):
        app = yaml.safe_load((ARGOCD / "application.yaml").read_text())
        crd = yaml.safe_load((ROOT / "crds" / "kuberl.io_rlexperiments.yaml").read_text())
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        (ignore,) = [i for i in app["spec"]["ignoreDifferences"] if i["kind"] == "RLExperiment"]
        assert set(ignore["jsonPointers"]) == {"/spec/rollout/replicas", "/spec/suspend"}
        for pointer in ignore["jsonPointers"]:
            node = schema
            for part in pointer.strip("/").split("/"):
                node = node["properties"][part]
        assert "RespectIgnoreDifferences=true" in app["spec"]["syncPolicy"]["syncOptions"]

    def test_operator_application_installs_the_chart_in_this_repository(self):
        app = yaml.safe_load((ARGOCD / "operator-application.yaml").read_text())
        chart = ROOT / app["spec"]["source"]["path"]
        assert (chart / "Chart.yaml").exists()
        assert "ServerSideApply=true" in app["spec"]["syncPolicy"]["syncOptions"]
