"""kubernetes-validate's check of built-in objects for the strict emulator (kuberl.testing.kube_store), cached.

`kubernetes_validate.validate` re-reads and re-parses its JSON schemas (the 1.3 MB `_definitions.json`
included) and builds a new validator on every call: tens of milliseconds per object, the emulator's
largest cost when the operator applies the children of 1,000 experiments (bench/bench_operator_scale.py).
`validate` here is the same check with the same schema files, validator class and errors
(kubernetes_validate.ValidationError, SchemaNotFoundError), with the parsed schemas and one validator per
(kind, apiVersion, version, strict) kept for the life of the process. The schemas are only read.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jsonschema
from kubernetes_validate import utils as kvu
from referencing import Registry, Resource


@functools.cache
def _schema_version(desired_version: str) -> str:
    """The newest schema version not newer than the one asked for (kubernetes_validate's rule)."""
    desired_version = desired_version.removeprefix("v")
    if kvu.major_minor(desired_version) > kvu.latest_version():
        raise kvu.VersionNotSupportedError(version=kvu.major_minor(desired_version))
    return [v for v in kvu.all_versions() if kvu.major_minor(v) <= kvu.major_minor(desired_version)][-1]


@functools.cache
def _definitions(schema_dir: str, desired_version: str) -> Any:
    return kvu.schema_contents(f"kubernetes-json-schema/{schema_dir}/_definitions.json", desired_version)


@functools.lru_cache(maxsize=512)
def _validator(kind: str, api_version: str, desired_version: str, strict: bool) -> tuple[jsonschema.protocols.Validator, str]:
    version = _schema_version(desired_version)
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)  # rbac.authorization.k8s.io/v1 -> rbac-v1
    schema_dir = f"v{version}-local" + ("-strict" if strict else "")
    try:
        schema = kvu.schema_contents(f"kubernetes-json-schema/{schema_dir}/{kind.lower()}-{group_version}.json", desired_version)
    except FileNotFoundError:
        raise kvu.SchemaNotFoundError(version=kvu.major_minor(desired_version), kind=kind, api_version=api_version) from None
    registry: Registry = Resource.from_contents(schema) @ Registry()
    registry = Resource.from_contents(_definitions(schema_dir, desired_version)) @ registry
    return jsonschema.validators.Draft202012Validator(schema, registry=registry), kvu.major_minor(version)


def validate(data: dict[str, Any], desired_version: str, strict: bool = False) -> str:
    """kubernetes_validate.validate(data, desired_version, strict), cached: the schema version used, or
    kubernetes_validate.ValidationError / SchemaNotFoundError."""
    validator, version = _validator(data["kind"], data["apiVersion"], desired_version, strict)
    try:
        validator.validate(data)
    except jsonschema.ValidationError as exc:
        raise kvu.ValidationError(exc, version=version) from None
    return version
