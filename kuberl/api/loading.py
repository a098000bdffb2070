"""Read RLExperiment manifests from YAML files (used by `kuberl run`, `kuberl validate` and the roles)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kuberl.api.v1alpha1 import KIND, RLExperiment


def load_documents(path: str | Path) -> list[dict[str, Any]]:
    """All non-empty YAML documents of a file; a YAML error names the file and line."""
    text = Path(path).read_text()
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from exc
    for d in docs:
        if not isinstance(d, dict):
            raise ValueError(f"{path}: a document is a {type(d).__name__}, not a mapping")
    return docs


def load_experiments(path: str | Path) -> list[RLExperiment]:
    """Every RLExperiment in a file, validated by the models (raises pydantic.ValidationError)."""
    return [RLExperiment.model_validate(d) for d in load_documents(path) if d.get("kind") == KIND]


def load_experiment(path: str | Path) -> RLExperiment:
    """The one RLExperiment of a file."""
    exps = load_experiments(path)
    if len(exps) != 1:
        raise ValueError(f"{path}: expected one {KIND}, found {len(exps)}")
    return exps[0]
