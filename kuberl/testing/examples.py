"""The example manifests the tests hold to the product: every file under examples/ (subfolders included, e.g. the
SkyPilot folder's experiment) that holds an RLExperiment. Files of other kinds there (Argo CD Applications, SkyPilot
tasks) are left out, and so is test data (the Argo CD health check's `testdata/`: experiments with a status, the inputs
of its Lua tests)."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def experiment_files(root: Path = ROOT) -> list[Path]:
    """Sorted paths of the example files that hold at least one RLExperiment."""
    def holds_experiment(path: Path) -> bool:
        try:
            return any(isinstance(d, dict) and d.get("kind") == "RLExperiment" for d in yaml.safe_load_all(path.read_text()))
        except yaml.YAMLError:
            return False
    return sorted(p for p in (root / "examples").rglob("*.yaml") if "testdata" not in p.parts and holds_experiment(p))
