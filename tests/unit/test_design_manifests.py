"""Manifests kept outside examples/ (docs/design/*.yaml: sketches that no test applies to a cluster) still pass
`kuberl validate`, so that the layouts they show stay ones admission accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from kuberl.api.loading import load_documents

ROOT = Path(__file__).resolve().parents[2]
SKETCHES = sorted((ROOT / "docs" / "design").glob("*.yaml"))


def test_there_are_sketches():
    assert any(p.name == "megatron-sketch.yaml" for p in SKETCHES)


@pytest.mark.parametrize("path", SKETCHES, ids=[p.name for p in SKETCHES])
def test_the_sketch_passes_validation(path, capsys):
    from kuberl.cli import main

    assert [d.get("kind") for d in load_documents(path)] == ["RLExperiment"]
    code = main(["validate", str(path)])
    assert code == 0, capsys.readouterr()
