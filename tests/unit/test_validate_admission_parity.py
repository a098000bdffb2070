"""`kuberl validate` decides as the real API server does (issue #36): one test per disagreement the admission-parity fuzzer
(bench/admission_parity.py against kube-apiserver v1.35) found, each with the server's decision written down."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kuberl.api import validation
from kuberl.api.crd import build_schema
from kuberl.api.validation import check_admission, check_cel, go_regex, validate_manifest


def doc(spec: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    out = {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "ok"},
           "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "add-small"}, **(spec or {})}}
    out.update(top)
    return out


def admitted(d: dict[str, Any]) -> bool:
    return check_admission(d)[1] is not None


def defaults_with_rules(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)] if "default" in node and isinstance(node["default"], dict) else []
    for key, sub in (node.get("properties") or {}).items():
        out += defaults_with_rules(sub, f"{path}.{key}")
    return out


def test_every_crd_default_passes_its_own_cel_rules_as_the_api_server_checks_them():
    # Bug: kube-apiserver refused the CRD ("no such key: minReplicas evaluating rule") because it evaluates a node's CEL
    # rules on its default as written (autoscaling: {}), before the nested defaults apply.
    nodes = defaults_with_rules(build_schema())
    assert {"spec.workflow", "spec.algorithm", "spec.rollout.autoscaling"} <= {p.lstrip(".") for p, _ in nodes}
    for path, node in nodes:
        assert check_cel(node, node["default"], path) == [], path


def test_the_default_check_catches_a_rule_that_reads_a_defaulted_field():
    node = {"type": "object", "default": {}, "x-kubernetes-validations": [{"rule": "self.minReplicas <= self.maxReplicas"}],
            "properties": {"minReplicas": {"type": "integer", "default": 1}, "maxReplicas": {"type": "integer", "default": 1}}}
    assert [e.path for e in check_cel(node, node["default"], "autoscaling")] == ["autoscaling"]


@pytest.mark.parametrize(("meta", "ok"), [
    ({"name": "ok", "extra": "x"}, False),  # strict decoding: unknown field "metadata.extra"
    ({"name": "ok", "Name": "q"}, False),
    ({"name": "ok", "labels": "team=rl"}, False),  # cannot unmarshal string into map[string]string
    ({"name": "ok", "labels": {"k": 1}}, False),
    ({"name": "ok", "namespace": 5}, False),
    ({"name": "ok", "finalizers": "f"}, False),
    ({"name": "ok", "generation": "5"}, False),
    ({"name": "ok", "creationTimestamp": "garbage"}, False),
    ({"name": "ok", "labels": {"bad key": "v"}}, False),
    ({"name": "ok", "labels": {"k": "bad value!"}}, False),
    ({"name": "ok", "labels": {"k": "x" * 64}}, False),
    ({"name": "ok", "labels": {"x" * 64: "v"}}, False),
    ({"name": "ok", "annotations": {"Bad Key": "v"}}, False),
    ({"name": "ok", "annotations": {"k": "x" * 300_000}}, False),
    ({"name": "ok", "finalizers": ["bad finalizer"]}, False),
    ({"name": "ok", "finalizers": [None]}, False),
    ({"name": "ok", "ownerReferences": [{"apiVersion": "v1", "kind": "X", "name": "n"}]}, False),  # uid must not be empty
    ({"generateName": "Fuzz-"}, False),
    ({"generateName": "-ok"}, False),
    ({"generateName": "ok."}, False),
    ({"generateName": "x" * 48}, False),  # the generated name (48 + 5) is longer than the CRD's 52
    ({"generateName": "1fuzz-"}, False),  # the generated name starts with a digit (DNS-1035)
    ({"name": "ok", "labels": {"example.com/k": "", "k": "v", "a": None}, "annotations": {"Example.com/K": "any\n"}}, True),
    ({"name": "ok", "finalizers": ["f", "example.com/f"], "uid": "abc", "resourceVersion": "5", "generation": 5}, True),
    ({"name": "ok", "creationTimestamp": "2020-01-01T00:00:00Z", "namespace": None, "labels": None}, True),
    ({"name": "ok", "ownerReferences": [{"apiVersion": "v1", "kind": "X", "name": "n", "uid": "u"}]}, True),
    ({"generateName": "ok"}, True),
    ({"generateName": "x" * 47}, True),
    ({"name": "", "generateName": "ok-"}, True),
])
def test_metadata_is_decoded_and_validated_as_the_api_server_does(meta, ok):
    assert admitted(doc(metadata=meta)) is ok


@pytest.mark.parametrize(("status", "ok"), [
    ({"phase": "NotAPhase"}, True), ("x", True), ([1, 2], True), ({"conditions": "x"}, True), (None, True),
    ({"unknown": 1}, False), ({"progress": {"zz": 1}}, False), ({"conditions": [{"type": "A", "bogus": 1}]}, False),
    ([{"a": 1}], False), ({"phase": None, "zz": None}, False),
])
def test_status_is_dropped_on_create_but_strict_decoding_still_names_its_unknown_fields(status, ok):
    assert admitted(doc(status=status)) is ok


@pytest.mark.parametrize(("spec", "ok"), [
    ({"workflow": {"reward": "math\n"}}, False),  # Python's `$` matched before the final newline; RE2's does not
    ({"allocation": "vllm:d2+fsdp:d2\n"}, False),
    ({"checkpoint": {"size": "10Gi\n"}}, False),
    ({"workflow": {"reward": "pkg.modé:fn"}}, False),  # \w is ASCII in RE2
    ({"workflow": {"reward": "pkg.mod:f\u0661"}}, False),
    ({"bus": {"external": {"url": "nats://a\x0bb"}}}, True),  # \s is [\t\n\f\r ] in RE2: \v and Unicode spaces are \S
    ({"bus": {"external": {"url": "nats://a\u00a0b"}}}, True),
    ({"tracking": {"mlflow": {"trackingUri": "http://x\u2028y"}}}, True),
    ({"bus": {"external": {"url": "nats://a b"}}}, False),
])
def test_patterns_are_go_regexps(spec, ok):
    assert admitted(doc(spec)) is ok


def test_go_regex_translation():
    assert go_regex(r"^a$").search("a") and not go_regex(r"^a$").search("a\n")
    assert go_regex(r"^[\w.$]+$").search("a.$") and not go_regex(r"^\w+$").search("é")
    assert go_regex(r"^\S+$").search("a\x0bb") and not go_regex(r"^\S+$").search("a\tb")
    assert go_regex(r"^[]a]+$").search("]a") and go_regex(r"^[^$]+$").search("ab")


@pytest.mark.parametrize(("spec", "ok"), [
    ({"seed": 1.0}, True),  # a whole float64 is an integer to kube-openapi's type check
    ({"seed": 3.0000000001}, True),  # ... and so is one within its relative 1e-9 (swag.IsFloat64AJSONInteger)
    ({"seed": 100000.00001}, True),
    ({"seed": 1.000000003}, False),
    ({"seed": 0.5}, False),
    ({"seed": 2**63}, False),  # past int64: decoded as a float64, past 2**53
    ({"seed": 10**20}, False),
    ({"seed": 9007199254740993.0}, False),
    ({"seed": 9007199254740991.0}, True),
    ({"seed": -0.0}, True),
    ({"ttlSecondsAfterFinished": -1.0000000001}, False),
    ({"bus": {"embedded": {"replicas": 3.0000000001}}}, True),  # the enum compares int64(value): truncated
    ({"bus": {"embedded": {"replicas": 1.0}}}, True),
    ({"bus": {"embedded": {"storage": 3.0}}}, True),
    ({"bus": {"embedded": {"storage": 0.5}}}, False),
])
def test_numbers_are_integers_as_the_api_server_decides(spec, ok):
    assert admitted(doc(spec)) is ok


@pytest.mark.parametrize(("spec", "ok"), [
    ({"rollout": {"autoscaling": {"minReplicas": 1.0}}}, False),  # CEL: "invalid data, expected int, got float64"
    ({"trainer": {"parallelism": {"tensor": 1.0}}}, False),
    ({"trainer": {"nodes": 2.0}}, False),
    ({"allocation": "vllm:d1+fsdp:d1", "trainer": {"nodes": 2.0}}, False),  # the allocation rule for trainer.nodes reads it (has() fails)
    ({"trainer": {"nodes": 2.0, "parallelism": {"data": 2}}, "allocation": "vllm:d1+fsdp:d2"}, False),
    ({"training": {"totalSteps": 5.0}}, False),  # has() of it fails too
    ({"training": {"epochs": 3.0, "totalSteps": 5}}, True),  # true || error is true
    ({"algorithm": {"samplesPerPrompt": 4.0}}, False),
    ({"algorithm": {"name": "liteppo", "samplesPerPrompt": 4.0}}, True),
    ({"evaluation": {"split": "t", "passAtK": [1.0]}}, False),
    ({"rollout": {"tensorParallelSize": 1.0}}, True),  # read by no rule that gets that far
    ({"rollout": {"replicas": 1.0}}, False),  # the /scale subresource reads spec.rollout.replicas as an int64
    ({"rollout": {"replicas": -0.0}}, False),
])
def test_a_float_in_an_integer_field_fails_where_cel_or_the_scale_subresource_reads_it(spec, ok):
    assert admitted(doc(spec)) is ok


def test_unknown_fields_inside_objects_typed_otherwise_are_named_as_pruning_names_them():
    errors = []
    validation.unknown_fields({"type": "object", "properties": {"a": {"type": "string"}, "l": {"type": "object"}}},
                              {"a": {"x": 1}, "l": [{"y": 1}, 2], "z": None}, "spec", errors)
    assert sorted(e.path for e in errors) == ["spec.a.x", "spec.l[0].y", "spec.z"]


def test_free_form_content_next_to_declared_fields_reaches_the_models():
    # x-kubernetes-preserve-unknown-fields with a declared `name`: the rest of a core/v1 Volume is kept, not dropped.
    d = doc({"trainer": {"podTemplate": {"volumes": [{"name": "extra", "emptyDir": {"medium": "Memory"}}]}}})
    errors, stored = check_admission(d)
    assert errors == [] and stored["spec"]["trainer"]["podTemplate"]["volumes"] == [{"name": "extra", "emptyDir": {"medium": "Memory"}}]
    assert validate_manifest(copy.deepcopy(d)) == []


def schema_patterns(node: dict[str, Any]) -> set[str]:
    out = {node["pattern"]} if "pattern" in node else set()
    for sub in [*(node.get("properties") or {}).values(), node.get("items"), node.get("additionalProperties")]:
        out |= schema_patterns(sub) if isinstance(sub, dict) else set()
    return out


def test_the_models_patterns_mean_what_the_api_servers_do():
    # Bug: pydantic's regexps (Rust) read \S and \w as Unicode classes, the API server's (RE2) as ASCII: a bus URL with a
    # no-break space was admitted and then refused by the operator; `kuberl run` took an import path with an é.
    from typing import Annotated

    import pydantic

    from kuberl.testing.admission_fuzz import EDGES, STRINGS

    patterns = schema_patterns(build_schema())
    assert len(patterns) >= 10
    for pattern in patterns:
        model = pydantic.TypeAdapter(Annotated[str, pydantic.Field(pattern=pattern)])
        samples = [s for s in STRINGS if go_regex(pattern).search(s)] or ["x"]
        for text in STRINGS + [s[:i] + e + s[i:] for s in samples for e in EDGES for i in (0, 1, len(s))]:
            try:
                model.validate_python(text)
                ours = True
            except pydantic.ValidationError:
                ours = False
            assert ours == bool(go_regex(pattern).search(text)), (pattern, text)


def test_error_lists_match_the_api_servers():
    # A pattern or a bound does not stop the CEL rules (only types, enums, required, too long/many do): both are named.
    errors = check_admission(doc({"bus": {"embedded": {}, "external": {"url": "http://x"}}}))[0]
    assert {e.path for e in errors} == {"spec.bus.external.url", "spec.bus"}
    errors = check_admission(doc({"bus": {"embedded": {}, "external": {"url": 5}}}))[0]
    assert {e.path for e in errors} == {"spec.bus.external.url"}
    # every missing required field, not the first one
    errors = check_admission(doc({"algorithm": {"lora": {}}}))[0]
    assert {(e.path, e.kind) for e in errors} == {("spec.algorithm.lora.rank", "Required value"), ("spec.algorithm.lora.alpha", "Required value")}
    # a null metadata decodes as an empty one: the name is what is missing; a CEL evaluation error is named where its rule sits
    assert [e.path for e in check_admission(doc(metadata=None))[0]] == ["metadata.name"]
    assert [e.path for e in check_admission(doc({"trainer": {"parallelism": {"tensor": 1.0}}}))[0]] == ["spec"]
