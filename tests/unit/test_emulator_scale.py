"""The strict API emulator's fast paths (bench/bench_operator_scale.py --n 1000) keep it exactly as strict.

Cached kubernetes-validate schemas (kuberl.testing.builtin_schemas) reject what kubernetes_validate
rejects, with the same error; JSON apply patches skip the YAML parser but YAML ones still parse; a LIST
reads its own kind only, without deleted objects; a memoised CEL result never lets a changed value
through. Each check runs through the HTTP API, as the operator and kubectl use it.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from typing import Any

import kubernetes_validate
import pytest
import requests

from kuberl.testing import builtin_schemas
from kuberl.testing.emulator_server import EmulatorServer, default_crds

NS = "default"
CM = f"/api/v1/namespaces/{NS}/configmaps"
STS = f"/apis/apps/v1/namespaces/{NS}/statefulsets"
RLX = f"/apis/kuberl.io/v1alpha1/namespaces/{NS}/rlexperiments"


@pytest.fixture(scope="module")
def emu() -> Iterator[EmulatorServer]:
    with EmulatorServer(default_crds()) as server:
        yield server


def call(emu: EmulatorServer, method: str, path: str, body: Any = None, ctype: str = "application/json", raw: str | None = None) -> requests.Response:
    data = raw if raw is not None else (None if body is None else json.dumps(body))
    return requests.request(method, emu.url + path, data=data, headers={"Content-Type": ctype}, timeout=30)


def statefulset(name: str, replicas: Any = 1) -> dict[str, Any]:
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": name, "namespace": NS},
            "spec": {"replicas": replicas, "serviceName": name, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}}}}


def experiment(name: str, replicas: int = 1) -> dict[str, Any]:
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
                     "rollout": {"replicas": replicas, "accelerator": {"type": "cpu", "count": 0}},
                     "trainer": {"accelerator": {"type": "cpu", "count": 1}}}}


class TestCachedBuiltinValidation:
    @pytest.mark.parametrize("strict", [False, True])
    def test_the_same_verdict_and_error_as_kubernetes_validate(self, strict: bool) -> None:
        good = statefulset("v1")
        bad = statefulset("v2", replicas="three")
        unknown = copy.deepcopy(good)
        unknown["spec"]["bogus"] = 1
        for obj in (good, bad, unknown):
            expected = got = None
            try:
                kubernetes_validate.validate(obj, "1.32", strict=strict)
            except kubernetes_validate.ValidationError as exc:
                expected = (list(exc.absolute_path), exc.message, exc.version)
            try:
                builtin_schemas.validate(obj, "1.32", strict=strict)
            except kubernetes_validate.ValidationError as exc:
                got = (list(exc.absolute_path), exc.message, exc.version)
            assert got == expected, obj
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):
            builtin_schemas.validate({"apiVersion": "example.com/v1", "kind": "Nothing"}, "1.32")

    def test_every_write_is_still_validated_and_the_cache_makes_it_fast(self, emu) -> None:
        assert call(emu, "POST", STS, statefulset("c1")).status_code == 201
        r = call(emu, "POST", STS, statefulset("c2", replicas="three"))
        assert r.status_code == 422 and "spec.replicas" in r.json()["message"], r.text
        r = call(emu, "PATCH", f"{STS}/c1", {"spec": {"replicas": "four"}}, "application/merge-patch+json")
        assert r.status_code == 422, r.text
        obj = statefulset("c1")
        started = time.perf_counter()
        for _ in range(20):
            builtin_schemas.validate(obj, "1.32", strict=True)
        per_object = (time.perf_counter() - started) / 20
        assert per_object < 0.004, f"{per_object * 1000:.1f} ms per object: the schemas are not cached"


class TestApplyPatchBodies:
    def test_a_json_and_a_yaml_apply_patch_both_apply(self, emu) -> None:
        body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ap1"}, "data": {"a": "1"}}
        assert call(emu, "PATCH", f"{CM}/ap1?fieldManager=m", body, "application/apply-patch+yaml").status_code == 201
        yaml_text = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: ap1\ndata:\n  a: '2'\n  b: yes-string\n"
        r = call(emu, "PATCH", f"{CM}/ap1?fieldManager=m", ctype="application/apply-patch+yaml", raw=yaml_text)
        assert r.status_code == 200 and r.json()["data"] == {"a": "2", "b": "yes-string"}, r.text
        r = call(emu, "PATCH", f"{CM}/ap1?fieldManager=m", ctype="application/apply-patch+yaml", raw="data: [unclosed")
        assert r.status_code == 400 and "not valid JSON/YAML" in r.json()["message"], r.text


class TestListByKind:
    def test_a_list_returns_its_kind_only_without_deleted_objects(self, emu) -> None:
        for name in ("l2", "l1", "l3"):
            assert call(emu, "POST", CM, {"metadata": {"name": name, "labels": {"set": "l"}}}).status_code == 201
        assert call(emu, "POST", STS, statefulset("l1")).status_code == 201
        assert call(emu, "DELETE", f"{CM}/l2").status_code == 200
        items = call(emu, "GET", f"{CM}?labelSelector=set%3Dl").json()["items"]
        assert [(i["kind"], i["metadata"]["name"]) for i in items] == [("ConfigMap", "l1"), ("ConfigMap", "l3")]
        assert call(emu, "POST", CM, {"metadata": {"name": "l2", "labels": {"set": "l"}}}).status_code == 201
        assert [i["metadata"]["name"] for i in call(emu, "GET", f"{CM}?labelSelector=set%3Dl").json()["items"]] == ["l1", "l2", "l3"]

    def test_a_listed_object_is_a_snapshot(self, emu) -> None:
        assert call(emu, "POST", CM, {"metadata": {"name": "s1"}, "data": {"v": "1"}}).status_code == 201
        before = call(emu, "GET", f"{CM}?fieldSelector=metadata.name%3Ds1").json()["items"][0]
        call(emu, "PATCH", f"{CM}/s1", {"data": {"v": "2"}}, "application/merge-patch+json")
        assert before["data"] == {"v": "1"}
        assert emu.call(lambda e: e.get_object(("", "v1", "configmaps"), NS, "s1"))["data"] == {"v": "2"}


class TestCelResults:
    def test_a_remembered_verdict_never_admits_a_changed_value(self, emu) -> None:
        """The CRD's CEL rules are checked on every write: the same spec twice, then a value a rule rejects."""
        assert call(emu, "POST", RLX, experiment("cel1")).status_code == 201
        assert call(emu, "POST", RLX, experiment("cel2")).status_code == 201  # the same spec: remembered verdicts
        bad = experiment("cel3")
        bad["spec"]["rollout"]["accelerator"] = {"type": "nvidia", "count": 0}
        r = call(emu, "POST", RLX, bad)
        assert r.status_code == 422, r.text
        r = call(emu, "PATCH", f"{RLX}/cel1", {"spec": {"rollout": {"accelerator": {"type": "nvidia", "count": 0}}}}, "application/merge-patch+json")
        assert r.status_code == 422, r.text
