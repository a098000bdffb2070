"""The pure API-server semantics behind the strict emulator (kuberl.testing.kube_semantics, kube_writes)."""

from __future__ import annotations

from typing import ClassVar

import pytest

from kuberl.testing import kube_semantics as ks
from kuberl.testing import kube_writes as kw


class TestSelectors:
    @pytest.mark.parametrize(("selector", "labels", "ok"), [
        ("a=1", {"a": "1"}, True),
        ("a==1,b!=2", {"a": "1", "b": "3"}, True),
        ("a!=1", {"a": "1"}, False),
        ("a in (1, 2)", {"a": "2"}, True),
        ("a notin (1,2)", {"a": "2"}, False),
        ("a", {"a": ""}, True),
        ("!a", {"a": "x"}, False),
        ("", {}, True),
    ])
    def test_label_selector_syntax(self, selector: str, labels: dict[str, str], ok: bool) -> None:
        assert ks.label_selector_matches(selector, labels) is ok

    def test_an_unparsable_label_selector_is_a_400(self) -> None:
        with pytest.raises(ks.ApiError) as info:
            ks.label_selector_matches("a in", {})
        assert info.value.code == 400

    def test_field_selectors_read_nested_fields(self) -> None:
        ev = {"metadata": {"name": "e1"}, "involvedObject": {"name": "x", "kind": "RLExperiment"}}
        assert ks.field_selector_matches("involvedObject.name=x,metadata.name!=e2", ev)
        assert not ks.field_selector_matches("involvedObject.kind=Pod", ev)


class TestPatches:
    def test_a_merge_patch_merges_maps_deletes_nulls_and_replaces_lists(self) -> None:
        old = {"a": {"b": 1, "c": 2}, "l": [1, 2]}
        assert kw.merge_patch(old, {"a": {"b": None, "d": 3}, "l": [3]}) == {"a": {"c": 2, "d": 3}, "l": [3]}
        assert old == {"a": {"b": 1, "c": 2}, "l": [1, 2]}, "the target is not mutated"

    def test_a_strategic_merge_patch_merges_containers_by_name(self) -> None:
        old = {"spec": {"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "1"}]}}
        patch = {"spec": {"$setElementOrder/containers": [{"name": "a"}, {"name": "b"}],
                          "containers": [{"name": "b", "image": "2"}, {"name": "a", "$patch": "delete"}]}}
        assert kw.strategic_merge_patch(old, patch) == {"spec": {"containers": [{"name": "b", "image": "2"}]}}

    def test_a_failed_json_patch_test_is_422_and_a_bad_path_too(self) -> None:
        with pytest.raises(ks.ApiError) as info:
            kw.json_patch({"a": 1}, [{"op": "test", "path": "/a", "value": 2}])
        assert info.value.code == 422
        with pytest.raises(ks.ApiError):
            kw.json_patch({"a": 1}, [{"op": "remove", "path": "/nope"}])

    def test_server_side_apply_records_the_manager_and_drops_what_it_no_longer_applies(self) -> None:
        first = kw.server_side_apply(None, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"},
                                            "data": {"a": "1", "b": "2"}}, "m")
        assert first["metadata"]["managedFields"][0]["manager"] == "m"
        first["data"]["c"] = "someone else's"
        second = kw.server_side_apply(first, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"},
                                              "data": {"a": "1"}}, "m")
        assert second["data"] == {"a": "1", "c": "someone else's"}


class TestTablesAndPaths:
    def test_json_paths_with_index_and_filter(self) -> None:
        obj = {"status": {"conditions": [{"type": "Ready", "status": "True"}], "list": [5]}}
        assert ks.json_path_get(obj, '.status.conditions[?(@.type=="Ready")].status') == "True"
        assert ks.json_path_get(obj, ".status.list[0]") == 5
        assert ks.json_path_get(obj, ".status.missing.deeper") is None

    def test_a_crd_table_has_the_printer_columns_and_a_name_column(self) -> None:
        crd = {"metadata": {"name": "xs.g"}, "spec": {"group": "g", "names": {"plural": "xs", "kind": "X"}, "scope": "Namespaced",
               "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                             "additionalPrinterColumns": [{"name": "Phase", "type": "string", "jsonPath": ".status.phase"}]}]}}
        rt = ks.resource_from_crd(crd)[0]
        table = ks.table(rt, [{"metadata": {"name": "a"}, "status": {"phase": "Running"}}], "Metadata", "7")
        assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Phase"]
        assert table["rows"][0]["cells"] == ["a", "Running"]
        assert table["rows"][0]["object"]["kind"] == "PartialObjectMetadata"


class TestCrdAdmission:
    SCHEMA: ClassVar[dict] = {"type": "object", "properties": {"spec": {
        "type": "object",
        "x-kubernetes-validations": [{"rule": "self.min <= self.max", "message": "min must be <= max"}],
        "properties": {"min": {"type": "integer", "default": 1}, "max": {"type": "integer", "minimum": 0, "exclusiveMinimum": True},
                       "size": {"x-kubernetes-int-or-string": True, "pattern": "^[0-9]+Gi$"}}}}}

    def test_defaults_are_filled_and_unknown_fields_pruned(self) -> None:
        obj, errors, unknown = kw.CrdAdmission(self.SCHEMA).admit({"spec": {"max": 2, "extra": 1}}, strict_fields=False)
        assert errors == [] and obj["spec"] == {"max": 2, "min": 1} and unknown == [".spec.extra"]

    def test_exclusive_minimum_and_int_or_string_follow_openapi_3_0(self) -> None:
        _, errors, _ = kw.CrdAdmission(self.SCHEMA).admit({"spec": {"max": 0, "size": "ten"}}, strict_fields=False)
        fields = {f for f, _ in errors}
        assert {"spec.max", "spec.size"} <= fields
        _, errors, _ = kw.CrdAdmission(self.SCHEMA).admit({"spec": {"max": 3, "size": 5}}, strict_fields=False)
        assert errors == []

    def test_cel_sees_a_number_field_as_a_double_even_when_the_json_says_1(self) -> None:
        schema = {"type": "object", "properties": {"spec": {"type": "object", "properties": {"p": {"type": "number"}},
                  "x-kubernetes-validations": [{"rule": "!has(self.p) || self.p == 1.0", "message": "p must be 1"}]}}}
        assert kw.CrdAdmission(schema).admit({"spec": {"p": 1}}, strict_fields=True)[1] == []
        assert kw.CrdAdmission(schema).admit({"spec": {"p": 0.5}}, strict_fields=True)[1] == [("spec", "p must be 1")]

    def test_cel_rules_report_their_message_at_their_path(self) -> None:
        _, errors, _ = kw.CrdAdmission(self.SCHEMA).admit({"spec": {"min": 5, "max": 2}}, strict_fields=True)
        assert errors == [("spec", "min must be <= max")]


class TestImmutability:
    def test_a_statefulset_may_change_replicas_but_not_its_selector(self) -> None:
        old = {"spec": {"replicas": 1, "selector": {"matchLabels": {"a": "1"}}}}
        assert kw.immutable_violations("statefulsets", old, {"spec": {"replicas": 3, "selector": {"matchLabels": {"a": "1"}}}}) == []
        assert kw.immutable_violations("statefulsets", old, {"spec": {"replicas": 1, "selector": {"matchLabels": {"a": "2"}}}})

    def test_a_job_template_is_immutable_but_suspend_is_not(self) -> None:
        old = {"spec": {"suspend": False, "template": {"spec": {"containers": [{"name": "c", "image": "1"}]}}}}
        assert kw.immutable_violations("jobs", old, {"spec": {**old["spec"], "suspend": True}}) == []
        changed = {"spec": {"suspend": False, "template": {"spec": {"containers": [{"name": "c", "image": "2"}]}}}}
        assert kw.immutable_violations("jobs", old, changed) == [("spec.template", "Invalid value: field is immutable")]
