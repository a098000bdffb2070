"""Deterministic RLExperiment manifests for admission parity (issue #36): what the API server admits, `kuberl validate` must.

`generate(n, seed)` yields `n` distinct `Case`s. The first ones are the seeds unchanged: every RLExperiment of
examples/*.yaml and every manifest of tests/invalid/*.yaml. Each later case starts from a seed or from a manifest
synthesized from the CRD's schema (`synthesize`) and applies one to three mutations (`MUTATIONS`): wrong JSON types,
numbers at and past their bounds, unknown and near-miss fields, deleted required fields, nulls, enum typos, list
items deleted, duplicated or added, random strings where names, quantities and patterns are expected, the fields
the CEL rules read set in random combinations, deep random JSON under free-form fields, metadata variants, number
edge cases (1.0 in an integer, 2**63), random subtrees, and a status block (ignored on create).

Case `i` of seed `s` depends on `random.Random(f"{s}/{i}")` only (no global state, no clock): the same call gives
the same manifests on every machine. Everything here is a pure function of its arguments and the files it reads.
"""

from __future__ import annotations

import copy
import functools
import json
import random
import re
import string
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kuberl.api.crd import build_schema

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "admission-fuzz"  # the namespace the runner posts to; metadata.namespace is only ever this one (or a wrong type)
Path_ = tuple[str | int, ...]

# Strings tried where a string goes: names, quantities, import paths, URLs, whitespace and Unicode edge cases.
STRINGS = [
    "", " ", "a", "A", "x" * 52, "x" * 53, "x" * 64, "x" * 129, "x" * 254, "ok", "ok\n", " ok", "ok ", "Ok", "o_k", "o.k", "o-k", "-ok", "ok-",
    "1ok", "é", "名前", "a\u00a0b", "a\x0bb", "a\tb", "nats://nats:4222", "nats://a\x0bb", "nats://a b", "tls://x", "http://x", "https://w.example",
    "file:/tmp/m", "hf-token", "HF_Token", "a.b.c", "pkg.mod:Fn", "pkg.mod:Fn\n", "pkg-mod:fn", "mod:", ":fn", "math", "exact-match",
    "repeat-digit", "Math", "10Gi", "10GB", "500m", "1e3", "1E3", "+1", "-1", ".5", "1.", "0x10", "1Ei", "1ki", "10Gi\n", "١٢", "0", "1.5Mi",
    "12e", "1e1000", "vllm:d2+fsdp:d2", "sglang:d4+fsdp:d4", "vllm:d2t2+megatron:d2p2t2", "vllm:d1+megatron:d1c2",
    "vllm:d2+megatron:d4e2", "vllm:d2+fsdp:d2e2", "vllm:d2+fsdp:d2d2", "vllm:d0+fsdp:d1", "vllm:d2-fsdp:d2", "vllm:d2+fsdp:d2\n",
    "A" + "B" * 55, "A" + "b" * 55, "kuberl.io/operator", "kueue.x-k8s.io/multikueue", "Kuberl.io/x", "tb/run1", "../up", "/abs",
    "NCCL_DEBUG", "KUBERL_X", "kuberl.io/x", "app.kubernetes.io/name", "team", "example.com/team", "-bad", "q_proj", "lm_head",
    "model.embed_tokens", "null", "true", "${VAR}", "\u212a", "ok\u0000",
]
INTS = [0, 1, -1, 2, 3, 4, 7, 8, 16, 64, 65, 255, 256, 257, 1024, 1025, 4096, 65535, 65536, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 10**20]
FLOATS = [0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 1e-9, 1e-300, 0.9999999999, 1.0000000001, 10.0, 1e308, -3.25, 3e-4]
# Whole floats (1.0: an integer to the API server's schema, not to its CEL), nearly whole ones (kube-openapi's 1e-9 tolerance),
# past 2**53 and int64, and no numbers at all.
NUMBER_EDGES = [1.0, 2.5, 4.0, 3.0000000001, 1.0000000001, 1.000000003, 100000.00001, 0.5, -0.0, -1.0000000001, 9007199254740991.0,
                9007199254740993.0, 1e20, 2**63, 2**63 - 1, 2**64, -(2**63) - 1, True, "1", 1e-320, 10**30, 0.1 + 0.2]
# Where Python's re and Go's RE2 part ways: `$` before a final newline, Unicode \w and \d, \s with \v or a no-break space.
EDGES = ["\n", "\x0b", "\u00a0", "é", "\u0661", "\u212a", " ", "\t", "\r\n", "_", "."]
ALLOCATIONS = [s for s in STRINGS if "+" in s or "-fsdp" in s] + [
    "vllm:d1+fsdp:d1", "vllm:d4+fsdp:d8", "vllm:d2+fsdp:d6", "sglang:d2+megatron:d2t2", "vllm:d1+megatron:d2p2", "vllm:d2+megatron:d8e4",
    "vllm:d2+megatron:d8e3", "vllm:d1+megatron:d2c2e2", "vllm:d1+megatron:d2t2e2", "vllm:d1+fsdp:d2c2", "vllm:d1+fsdp:d16", "vllm:d3+fsdp:d3c1e1",
    "vllm:d1+megatron:d4e2c1", "vllm:d1+megatron:d4e02", "vllm:d1+megatron:d1e1", "vllm:d1+fsdp:d2e1", "vllm:p2+fsdp:t1"]
# The fields the CEL rules read, with the values that move them across their rules' boundaries (cel_combo).
CEL_KNOBS: dict[str, list[Any]] = {
    "allocation": ALLOCATIONS, "rollout.engine": ["vllm", "sglang"], "rollout.replicas": [0, 1, 2, 4, 8],
    "rollout.tensorParallelSize": [1, 2, 4], "rollout.pipelineParallelSize": [1, 2], "rollout.accelerator.type": ["nvidia", "cpu", "ascend"],
    "rollout.accelerator.count": [0, 1, 2, 4, 8], "rollout.autoscaling.enabled": [True, False], "rollout.autoscaling.minReplicas": [0, 1, 2, 8],
    "rollout.autoscaling.maxReplicas": [1, 2, 4, 16], "rollout.image": ["img:1"], "trainer.backend": ["fsdp", "megatron"],
    "trainer.nodes": [1, 2, 3, 4], "trainer.accelerator.type": ["nvidia", "cpu", "ascend"], "trainer.accelerator.count": [0, 1, 2, 4, 8],
    "trainer.parallelism.data": [1, 2, 3, 4, 8], "trainer.parallelism.tensor": [1, 2, 4], "trainer.parallelism.pipeline": [1, 2],
    "trainer.parallelism.context": [1, 2, 3, 4], "trainer.parallelism.expert": [1, 2, 3, 4], "trainer.gradientCheckpointing": [True, False],
    "algorithm.lora": [{"rank": 8, "alpha": 16}, {"rank": 8, "alpha": 16, "targetModules": ["lm_head"]}, {"rank": 3, "alpha": 1.5}],
    "algorithm.name": ["grpo", "ppo", "rloo", "reinforce++", "liteppo", "dapo"], "algorithm.samplesPerPrompt": [1, 2, 4],
    "algorithm.epsClip": [0.2, 0.4, 1], "algorithm.epsClipHigh": [0.1, 0.28, 1], "algorithm.topP": [1, 1.0, 0.9],
    "weightSync.mode": ["disk", "bus", "broadcast"], "weightSync.inFlight": ["abort", "keep"], "checkpoint.asyncSave": ["auto", "on", "off"],
    "checkpoint.existingClaim": ["ckpt"], "checkpoint.storageClassName": ["standard"], "workflow.type": ["rlvr", "multi-turn", "custom", "agent"],
    "workflow.class": ["pkg.mod:Cls"], "workflow.agent": ["pkg.mod:run"], "workflow.exportStyle": ["concat", "individual"],
    "workflow.maxTurns": [1, 2, 4], "model.id": ["Qwen/Qwen2.5-0.5B"], "model.path": ["/models/q"], "model.builtin": ["tiny-qwen2"],
    "model.volume": [{"claimName": "models"}], "dataset.id": ["openai/gsm8k"], "dataset.path": ["/data/d.jsonl"], "dataset.builtin": ["add-small"],
    "dataset.volume": [{"claimName": "data"}], "evaluation.split": ["test"], "evaluation.path": ["/data/e.jsonl"],
    "evaluation.samplesPerPrompt": [0, 1, 4], "evaluation.passAtK": [[1], [1, 4], [8], []], "evaluation.greedy": [True, False],
    "bus.embedded": [{}, {"replicas": 3}], "bus.external.url": ["nats://nats:4222"], "bus.external.credentialsSecret": [{"name": "nats"}],
    "bus.external.accountSigningKeySecret": [{"name": "acct"}], "bus.external.account": ["A" + "B" * 55],
    "tracking.tensorboard": [{}], "tracking.wandb": [{"project": "p"}, {"project": "p", "mode": "offline"}, {"project": "p", "mode": "offline", "host": "https://w"}],
    "tracking.wandb.apiKeySecret": [{"name": "wandb"}], "tracking.mlflow": [{"trackingUri": "file:/m", "tokenSecret": {"name": "t"}}, {"trackingUri": "http://m"}],
    "tracking": [{}], "training.totalSteps": [1, 100], "training.epochs": [1, 3], "training": [{}],
    "rollout.podTemplate.labels": [{"team": "rl"}, {"kuberl.io/x": "y"}, {"app.kubernetes.io/name": "z"}],
    "trainer.podTemplate.annotations": [{"a": "b"}, {"kuberl.io/role": "x"}],
    "rollout.podTemplate.env": [[{"name": "NCCL_DEBUG", "value": "INFO"}], [{"name": "KUBERL_X", "value": "1"}]],
    "trainer.podTemplate.volumes": [[{"name": "extra", "emptyDir": {}}], [{"name": "model"}], [{"emptyDir": {}}]],
    "trainer.podTemplate.volumeMounts": [[{"name": "extra", "mountPath": "/x"}], [{"mountPath": "/x"}]],
}
FREE_FORM = [("rollout", "podTemplate", "env", 0, "valueFrom"), ("trainer", "podTemplate", "volumes", 0),
             ("rollout", "podTemplate", "volumeMounts", 0), ("trainer", "podTemplate", "topologySpreadConstraints", 0),
             ("rollout", "podTemplate", "volumes", 1)]
METADATA = {"name": ["fuzz", "a", "x" * 52, "x" * 53, "Fuzz", "1fuzz", "fuzz.x", "fuzz-", "fuzz_x", "f" + "-" * 50 + "x", "", 7, None],
            "generateName": ["fuzz-", "Fuzz-", "1fuzz-", "x" * 47, "x" * 48, "x" * 60, "fuzz.", "", 3],
            "namespace": [NAMESPACE, 5, ["x"]], "labels": [{"team": "rl"}, {"bad key": "v"}, {"k": "bad value!"}, {"example.com/k": ""},
                                                          {"k": "x" * 64}, {"k": 1}, "team=rl", {"x" * 64: "v"}],
            "annotations": [{"note": "any text\n"}, {"Bad Key": "v"}, {"example.com/k": "x" * 1000}, {"k": True}],
            "finalizers": [["example.com/f"], ["bad finalizer"], "f", ["f"], [None]], "uid": ["abc"], "extra": ["x"], "clusterName": ["c"],
            "ownerReferences": [[{"apiVersion": "v1", "kind": "X", "name": "n", "uid": "u"}], [{"apiVersion": "v1", "kind": "X", "name": "n"}]],
            "creationTimestamp": ["2020-01-01T00:00:00Z", "garbage", None], "generation": [5, "5"]}


@dataclass(frozen=True)
class Case:
    """One manifest: its index, the seed it came from and the mutations applied (`kind:path`)."""

    index: int
    source: str
    mutations: tuple[str, ...]
    doc: dict[str, Any]

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(m.split(":", 1)[0] for m in self.mutations) or ("seed",)


@functools.cache
def schema() -> dict[str, Any]:
    """The CRD's openAPIV3Schema (as `kuberl crd` writes it)."""
    return build_schema()


@functools.cache
def seeds(root: Path = ROOT) -> tuple[tuple[str, dict[str, Any]], ...]:
    """(file, manifest) of every RLExperiment under examples/ (kuberl.testing.examples) and every mapping of
    tests/invalid/*.yaml, sorted."""
    from kuberl.testing.examples import experiment_files

    out = []
    for files, only_kind in ((experiment_files(root), True), (sorted(root.glob("tests/invalid/*.yaml")), False)):
        for file in files:
            try:
                docs = [d for d in yaml.safe_load_all(file.read_text()) if isinstance(d, dict)]
            except yaml.YAMLError:
                continue
            for d in docs:
                if not only_kind or d.get("kind") == "RLExperiment":
                    out.append((str(file.relative_to(root)), json.loads(json.dumps(d, default=str))))
    return tuple(out)


# -- paths ------------------------------------------------------------------------------------------------------------


def doc_paths(node: Any, path: Path_ = ()) -> list[Path_]:
    """Every path present in a JSON value (dict keys and list indexes), parents before children."""
    out = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            out += doc_paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += doc_paths(v, (*path, i))
    return out


def schema_paths(node: dict[str, Any], path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    """(path, schema) of every node of the schema: `*` stands for a map key, `[]` for a list item."""
    out = [(path, node)]
    for k, sub in (node.get("properties") or {}).items():
        out += schema_paths(sub, (*path, k))
    if isinstance(node.get("items"), dict):
        out += schema_paths(node["items"], (*path, "[]"))
    if isinstance(node.get("additionalProperties"), dict):
        out += schema_paths(node["additionalProperties"], (*path, "*"))
    return out


@functools.cache
def _schema_index() -> tuple[tuple[tuple[str, ...], dict[str, Any]], ...]:
    return tuple(schema_paths(schema()))


def concrete(rng: random.Random, doc: dict[str, Any], spath: tuple[str, ...]) -> Path_:
    """A document path for a schema path: an existing list index or map key where there is one, else 0 or a new key."""
    out: list[str | int] = []
    node: Any = doc
    for part in spath:
        if part == "[]":
            part = rng.randrange(len(node)) if isinstance(node, list) and node else 0
        elif part == "*":
            part = rng.choice([*node, "fuzz"]) if isinstance(node, dict) and node else "fuzz"
        out.append(part)
        node = node[part] if isinstance(node, dict | list) and _has(node, part) else None
    return tuple(out)


def _has(node: Any, key: str | int) -> bool:
    return (isinstance(node, dict) and key in node) or (isinstance(node, list) and isinstance(key, int) and key < len(node))


def set_path(doc: Any, path: Path_, value: Any) -> None:
    """Set `value` at `path`, making missing dicts and lists (padded with empty objects) on the way."""
    node = doc
    for key, nxt in zip(path, path[1:]):
        if not isinstance(node, dict | list) or isinstance(node, list) and not isinstance(key, int):
            return  # a scalar or a list on the way: the mutation has nothing to hang on
        if isinstance(node, list):
            node.extend({} for _ in range(key + 1 - len(node)))
        if not _has(node, key) or not isinstance(node[key], dict | list):
            node[key] = [] if isinstance(nxt, int) else {}
        node = node[key]
    if isinstance(node, list) and isinstance(path[-1], int):
        node.extend({} for _ in range(path[-1] + 1 - len(node)))
        node[path[-1]] = value
    elif isinstance(node, dict):
        node[path[-1]] = value


def delete(doc: Any, path: Path_) -> None:
    node = doc
    for key in path[:-1]:
        if not _has(node, key):
            return
        node = node[key]
    if _has(node, path[-1]):
        del node[path[-1]]


def dotted(path: Path_) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or "(root)"


# -- values -----------------------------------------------------------------------------------------------------------


def random_json(rng: random.Random, depth: int = 3) -> Any:
    """A random JSON value: nested objects and lists down to `depth`, keys and scalars from the edge-case pools."""
    roll = rng.random()
    if depth > 0 and roll < 0.3:
        return {rng.choice([*STRINGS[:40], "name", "items", rng.choice(string.ascii_letters)]): random_json(rng, depth - 1)
                for _ in range(rng.randint(0, 4))}
    if depth > 0 and roll < 0.45:
        return [random_json(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    return rng.choice([rng.choice(STRINGS), rng.choice(INTS), rng.choice(FLOATS), True, False, None])


def other_type(rng: random.Random, value: Any) -> Any:
    """A value of another JSON type than `value`."""
    pools = {"s": STRINGS, "i": INTS, "f": [f for f in FLOATS if not f.is_integer()], "b": [True, False], "o": [{}, {"a": 1}], "l": [[], [1], ["a"]]}
    kind = {str: "s", int: "i", float: "f", bool: "b", dict: "o", list: "l"}.get(type(value))
    return copy.deepcopy(rng.choice(pools[rng.choice([k for k in pools if k != kind])]))


@functools.cache
def _matching(pattern: str) -> tuple[str, ...]:
    return tuple(s for s in STRINGS if re.search(pattern, s) and not s.endswith("\n"))


def synthesize(rng: random.Random, node: dict[str, Any], depth: int = 0) -> Any:
    """A random value for a schema node, mostly within its bounds: required properties always, optional ones at random."""
    if "enum" in node:
        return rng.choice(node["enum"])
    if node.get("x-kubernetes-int-or-string"):
        return rng.choice([rng.choice([0, 1, 4, 32]), rng.choice(_matching(node["pattern"]) if "pattern" in node else ["1"])])
    kind = node.get("type")
    if kind == "object" and "properties" in node:
        props = node["properties"]
        keep = [k for k in props if k in node.get("required", []) or rng.random() < 0.35 / (1 + depth)]
        return {k: synthesize(rng, props[k], depth + 1) for k in keep}
    if kind == "object":
        sub = node.get("additionalProperties")
        return {f"k{i}": synthesize(rng, sub, depth + 1) for i in range(rng.randint(0, 2))} if isinstance(sub, dict) else {}
    if kind == "array":
        low = node.get("minItems", 0)
        return [synthesize(rng, node["items"], depth + 1) for _ in range(rng.randint(low, max(low, 2)))]
    if kind in ("integer", "number"):
        low, high = node.get("minimum", 0), node.get("maximum", node.get("minimum", 0) + 64)
        value: Any = rng.randint(int(low), int(min(high, low + 16))) if kind == "integer" else rng.uniform(low, high)
        if node.get("exclusiveMinimum") and value <= low:
            value = low + 1 if kind == "integer" else (low + high) / 2
        return value
    if kind == "boolean":
        return rng.random() < 0.5
    if "pattern" in node:
        return rng.choice(_matching(node["pattern"]) or ("x",))
    return rng.choice(["value", "x" * node.get("minLength", 1), "standard"])


def synthesized_manifest(rng: random.Random) -> dict[str, Any]:
    spec = synthesize(rng, schema()["properties"]["spec"])
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": f"synth-{rng.randrange(10**6)}"}, "spec": spec}


# -- mutations: each changes `doc` in place and returns where (a dotted path); MUTATIONS names them ---------------------------


def _pick(rng: random.Random, doc: dict[str, Any], under: Path_ = ("spec",)) -> Path_:
    paths = [p for p in doc_paths(doc) if p[: len(under)] == under and len(p) > len(under)]
    return rng.choice(paths) if paths else under


def _pick_schema(rng: random.Random, want: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    """A (path, node) of the schema under spec whose node passes `want`; one in five inside the (large) core/v1 affinity."""
    found = [(p, n) for p, n in _schema_index() if p[:1] == ("spec",) and want(n)]
    inside = [f for f in found if "affinity" in f[0]]
    return rng.choice(inside if inside and rng.random() < 0.2 else [f for f in found if "affinity" not in f[0]] or found)


def wrong_type(rng, doc):
    """A value of another JSON type anywhere (spec mostly)."""
    path = _pick(rng, doc, rng.choice([("spec",), ("spec",), ()]))
    set_path(doc, path, other_type(rng, _get(doc, path)))
    return dotted(path)


def out_of_range(rng, doc):
    """A number, string length, list length or map size at, just inside or just past a bound of its schema."""
    spath, node = _pick_schema(rng, lambda n: any(k in n for k in ("minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems", "maxProperties")))
    edges: list[Any] = []
    for key, step in (("minimum", -1), ("maximum", 1)):
        if key in node:
            b = node[key]
            edges += [b, b + step, b + step * 1e-6, b - step] if node.get("type") == "number" else [int(b), int(b) + step, int(b) - step]
    for key, step in (("minLength", -1), ("maxLength", 1)):
        if key in node:
            edges += ["x" * max(0, node[key] + d) for d in (0, step)] + ["é" * node[key]]
    if "minItems" in node or "maxItems" in node:
        item = synthesize(rng, node["items"], 3)
        edges += [[copy.deepcopy(item) for _ in range(max(0, node.get(k, 0) + d))] for k, d in (("minItems", -1), ("maxItems", 0), ("maxItems", 1))]
    if "maxProperties" in node:
        edges += [{f"k{i}": synthesize(rng, node["additionalProperties"], 3) for i in range(node["maxProperties"] + d)} for d in (0, 1)]
    path = concrete(rng, doc, spath)
    set_path(doc, path, rng.choice(edges))
    return dotted(path)


def unknown_field(rng, doc):
    """A field no schema declares, mostly a near miss of a key that is there (case, plural, snake_case, cut short)."""
    path = rng.choice([p for p in doc_paths(doc) if isinstance(_get(doc, p), dict) and p[:1] != ("metadata",)])
    keys = list(_get(doc, path))
    k = rng.choice(keys or ["spec"]) or "spec"
    key = rng.choice([k.lower(), k.upper(), k + "s", re.sub(r"([A-Z])", r"_\1", k).lower(), k[:-1], k.capitalize(), "fuzz", "x-extra", ""])
    key = key + "X" if key in keys else key
    set_path(doc, (*path, key), random_json(rng, 2))
    return dotted((*path, key))


def missing_required(rng, doc):
    """A required field deleted (or, one time in three, any field)."""
    spath, node = rng.choice([(p, n) for p, n in _schema_index() if n.get("required")])
    path = concrete(rng, doc, spath)
    path = (*path, rng.choice(node["required"])) if rng.random() < 0.7 and isinstance(_get(doc, path), dict) else _pick(rng, doc, rng.choice([("spec",), ()]))
    delete(doc, path)
    return dotted(path)


def null(rng, doc):
    """A null anywhere: pruned and defaulted where the schema has a field, an error in a list, unknown where it has none."""
    path = _pick(rng, doc, rng.choice([("spec",), ("spec",), ("metadata",), ()]))
    set_path(doc, path, None)
    return dotted(path)


def enum_typo(rng, doc):
    """An enum field set to another allowed value or a typo of one (case, a space, a newline, cut short, a float for an int)."""
    spath, node = _pick_schema(rng, lambda n: "enum" in n)
    v = rng.choice(node["enum"])
    typos = [v, str(v).upper(), str(v).capitalize(), f"{v} ", f"{v}\n", f"{v}x", str(v)[:-1], ""]
    typos = typos if isinstance(v, str) else [v, v + 1, str(v), float(v), v + 1e-10, -v]
    path = concrete(rng, doc, spath)
    set_path(doc, path, rng.choice(typos))
    return dotted(path)


def list_edit(rng, doc):
    """A list item deleted, duplicated, inserted (random or null) or the list emptied; or a new list synthesized."""
    lists = [p for p in doc_paths(doc) if isinstance(_get(doc, p), list) and p[:1] == ("spec",)]
    if not lists or rng.random() < 0.4:
        spath, node = _pick_schema(rng, lambda n: n.get("type") == "array")
        path = concrete(rng, doc, spath)
        set_path(doc, path, synthesize(rng, node, 2))
        return dotted(path)
    path = rng.choice(lists)
    items, op = _get(doc, path), rng.choice(["delete", "duplicate", "append", "empty", "null"])
    if op == "delete" and items:
        items.pop(rng.randrange(len(items)))
    elif op == "duplicate" and items:
        items.append(copy.deepcopy(rng.choice(items)))
    elif op == "empty":
        items.clear()
    else:
        items.insert(rng.randrange(len(items) + 1), None if op == "null" else random_json(rng, 2))
    return f"{dotted(path)}({op})"


def random_string(rng, doc):
    """A string from the edge-case pool (or printable noise) where a string or a quantity goes."""
    spath, _ = _pick_schema(rng, lambda n: n.get("type") == "string" or n.get("x-kubernetes-int-or-string"))
    path = concrete(rng, doc, spath)
    set_path(doc, path, rng.choice(STRINGS) if rng.random() < 0.85 else "".join(rng.choice(string.printable) for _ in range(rng.randint(1, 20))))
    return dotted(path)


def pattern_edge(rng, doc):
    """A string that matches a field's pattern with one character where Python's re and Go's RE2 differ, at the end or inside."""
    spath, node = _pick_schema(rng, lambda n: "pattern" in n)
    good, edge = rng.choice(_matching(node["pattern"]) or ("x",)), rng.choice(EDGES)
    at = rng.choice([len(good), len(good), rng.randint(0, len(good))])
    path = concrete(rng, doc, spath)
    set_path(doc, path, good[:at] + edge + good[at:])
    return dotted(path)


def cel_combo(rng, doc):
    """Two to six of the fields the CEL rules read set (or deleted) together; an integer sometimes written as a float."""
    knobs = rng.sample(sorted(CEL_KNOBS), rng.randint(2, 6))
    for knob in knobs:
        value = copy.deepcopy(rng.choice(CEL_KNOBS[knob]))
        if isinstance(value, int) and not isinstance(value, bool) and rng.random() < 0.1:
            value = float(value)
        delete(doc, ("spec", *knob.split("."))) if rng.random() < 0.2 else set_path(doc, ("spec", *knob.split(".")), value)
    return ",".join(knobs)


def free_form(rng, doc):
    """Deep random JSON under a free-form field (env valueFrom, extra volumes and mounts, topology spread constraints)."""
    path = ("spec", *rng.choice(FREE_FORM))
    value = random_json(rng, 5)
    if isinstance(value, dict) and rng.random() < 0.7 and "valueFrom" not in path:
        value["name"] = rng.choice(["extra", "dshm", "", 5, None])
    set_path(doc, path, value if rng.random() < 0.9 else {"deep": random_json(rng, 6)})
    if "valueFrom" in path:
        set_path(doc, path[:-1] + ("name",), rng.choice(["FROM_SECRET", "KUBERL_TOKEN"]))
    return dotted(path)


def metadata(rng, doc):
    """A metadata field set to a valid or invalid value (names, generateName, labels, annotations, finalizers, unknown keys)."""
    doc["metadata"] = doc["metadata"] if isinstance(doc.get("metadata"), dict) else {}
    key = rng.choice(sorted(METADATA))
    doc["metadata"][key] = copy.deepcopy(rng.choice(METADATA[key]))
    if key == "generateName" and rng.random() < 0.7:
        doc["metadata"].pop("name", None)
    return f"metadata.{key}"


def number_edge(rng, doc):
    """A number field set to a float that is (or is nearly) whole, a value past int64 or 2**53, a boolean or a string."""
    spath, _ = _pick_schema(rng, lambda n: n.get("type") in ("integer", "number"))
    path = concrete(rng, doc, spath)
    set_path(doc, path, rng.choice(NUMBER_EDGES))
    return dotted(path)


def random_subtree(rng, doc):
    """An object of the spec replaced by random JSON or by a value synthesized from its schema."""
    path = rng.choice([p for p in doc_paths(doc) if p[:1] == ("spec",) and isinstance(_get(doc, p), dict)] or [("spec",)])
    set_path(doc, path, random_json(rng, 4) if rng.random() < 0.5 else synthesize(rng, _schema_at(path) or {}, 1))
    return dotted(path)


def status(rng, doc):
    """A status block: ignored on create, but strict decoding still names its unknown fields."""
    doc["status"] = rng.choice([{"phase": "Running"}, {"phase": "Bogus", "unknown": 1}, {"observedGeneration": "x"}, random_json(rng, 3)])
    return "status"


def _get(doc: Any, path: Path_) -> Any:
    for key in path:
        if not _has(doc, key):
            return None
        doc = doc[key]
    return doc


def _schema_at(path: Path_) -> dict[str, Any] | None:
    spath = tuple("[]" if isinstance(p, int) else p for p in path)
    index = dict(_schema_index())
    return index.get(spath) or index.get(spath[:-1] + ("*",))


MUTATIONS = {f.__name__: f for f in (wrong_type, out_of_range, unknown_field, missing_required, null, enum_typo, list_edit, random_string,
                                     pattern_edge, cel_combo, free_form, metadata, number_edge, random_subtree, status)}
# cel_combo and the bounds/strings/types matter most: they decide admission on well-formed manifests
WEIGHTS = {"cel_combo": 6, "out_of_range": 3, "random_string": 3, "pattern_edge": 2, "enum_typo": 2, "wrong_type": 2, "number_edge": 2, "unknown_field": 2,
           "null": 2, "missing_required": 2, "list_edit": 2, "free_form": 2, "metadata": 2, "random_subtree": 1, "status": 1}


def make_case(index: int, seed: int = 36, root: Path = ROOT) -> Case:
    """Case `index` of `seed`: a seed as it is (the first len(seeds) indexes), else a mutated seed or synthesized manifest."""
    bases = seeds(root)
    if index < len(bases):
        return Case(index, bases[index][0], (), copy.deepcopy(bases[index][1]))
    rng = random.Random(f"{seed}/{index}")
    valid = [b for b in bases if b[0].startswith("examples/")]
    roll = rng.random()
    source, doc = ("synthesized", synthesized_manifest(rng)) if roll < 0.15 else rng.choice(valid if roll < 0.85 else bases)
    doc = copy.deepcopy(doc)
    if not isinstance(doc.get("spec"), dict):
        doc["spec"] = {}
    names = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()), k=rng.choice([1, 1, 1, 2, 2, 3]))
    done = tuple(f"{name}:{MUTATIONS[name](rng, doc)}" for name in names)
    return Case(index, source, done, doc)


def generate(n: int, seed: int = 36, root: Path = ROOT) -> Iterator[Case]:
    """`n` cases with pairwise distinct manifests (a repeat is skipped; indexes stay those of make_case)."""
    seen: set[str] = set()
    index = 0
    while len(seen) < n:
        case = make_case(index, seed, root)
        index += 1
        key = json.dumps(case.doc, sort_keys=True)
        if key not in seen:
            seen.add(key)
            yield case
