"""The examples the guides and the chart's NOTES tell a user to apply can work where they say (B7):
each is a valid manifest, its checkpoint PVC asks for an access mode the named StorageClass serves,
and on EKS (which adds no GPU tolerations) every GPU pod tolerates the node groups' taint."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kuberl.api import RLExperiment
from kuberl.operator.builders import build_children

ROOT = Path(__file__).resolve().parents[2]
APPLY = re.compile(r"^kubectl apply -f (examples/\S+\.yaml)", re.M)
# StorageClasses each guide sets up or names as ReadWriteMany.
RWX_CLASSES = {"gke": {"standard-rwx", "premium-rwx", "enterprise-rwx"}, "eks": {"efs-kuberl"}}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def applied(page: Path) -> list[Path]:
    return [ROOT / m for m in APPLY.findall(page.read_text())]


def experiment(path: Path) -> RLExperiment:
    return RLExperiment.model_validate(yaml.safe_load(path.read_text()))


def checkpoint_pvc(exp: RLExperiment) -> dict:
    return next(c for c in build_children(exp, bus_token="t") if c["kind"] == "PersistentVolumeClaim" and c["metadata"]["name"].endswith("-checkpoints"))


@pytest.mark.parametrize("guide", ["gke", "eks"])
def test_the_guides_apply_a_manifest_placed_for_their_cluster(guide: str) -> None:
    paths = applied(ROOT / "docs" / "guides" / f"{guide}.md")
    assert paths, f"docs/guides/{guide}.md applies no example"
    for path in paths:
        assert path.exists(), path
        exp = experiment(path)
        pvc = checkpoint_pvc(exp)
        if "ReadWriteMany" in pvc["spec"]["accessModes"]:
            assert exp.spec.checkpoint.storage_class_name in RWX_CLASSES[guide], (
                f"{path.name}: the checkpoint PVC needs ReadWriteMany but names StorageClass "
                f"{exp.spec.checkpoint.storage_class_name!r}; the cluster default is ReadWriteOnce (Pending forever)")
        if guide == "eks":
            from kuberl.operator.capacity import tolerates

            for role in (exp.spec.rollout, exp.spec.trainer):
                assert role.accelerator.type != "nvidia" or tolerates(role.tolerations, GPU_TAINT), (
                    f"{path.name}: EKS adds no GPU tolerations; the pods would be Unschedulable on the tainted node groups")


def test_the_chart_notes_point_at_an_example_that_runs_on_any_cluster() -> None:
    notes = (ROOT / "charts" / "kuberl" / "templates" / "NOTES.txt").read_text()
    paths = [ROOT / m for m in re.findall(r"kubectl apply -f (examples/\S+\.yaml)", notes)]
    assert paths
    for path in paths:
        exp = experiment(path)
        assert checkpoint_pvc(exp)["spec"]["accessModes"] == ["ReadWriteOnce"], f"{path.name} needs ReadWriteMany: Pending on kind/minikube"
        assert exp.spec.rollout.accelerator.type == "cpu" and exp.spec.trainer.accelerator.type == "cpu"


def test_the_original_example_is_what_fails_there() -> None:
    # The check above can fail: gsm8k-grpo.yaml names no RWX class and has no toleration.
    exp = experiment(ROOT / "examples" / "gsm8k-grpo.yaml")
    assert "ReadWriteMany" in checkpoint_pvc(exp)["spec"]["accessModes"] and exp.spec.checkpoint.storage_class_name is None
    quick = experiment(ROOT / "examples" / "quickstart.yaml")
    assert "ReadWriteMany" in checkpoint_pvc(quick)["spec"]["accessModes"], "the local quickstart must not be what NOTES shows"
