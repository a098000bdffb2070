"""What a finished experiment's embedded bus holds (build_bus_statefulset's `finished`): after a success no server
and, unless bus.embedded.afterSuccess is Keep, no volume (the StatefulSet controller deletes the claims of the
servers it scales away when whenScaled is Delete: tests/integration/test_operator.py shows it on the real one);
after a failure no server, volumes kept (as a suspend keeps them)."""

from __future__ import annotations

import pytest

from kuberl.operator.builders import build_bus_statefulset
from tests.unit.test_builders import make_experiment


def shape(sts: dict) -> tuple[int, str]:
    return sts["spec"]["replicas"], sts["spec"]["persistentVolumeClaimRetentionPolicy"]["whenScaled"]


@pytest.mark.parametrize("finished, after_success, expected", [
    (None, "Delete", (3, "Retain")),  # running: servers up, a scale-down (suspend) keeps the volumes
    ("Succeeded", "Delete", (0, "Delete")),  # the default: nothing left billing
    ("Succeeded", "Keep", (3, "Retain")),  # kept to read the metrics stream after the run
    ("Failed", "Delete", (0, "Retain")),  # a failure keeps what was accepted and not trained
    ("Failed", "Keep", (0, "Retain")),
])
def test_a_finished_experiment_releases_its_bus_as_after_success_says(finished, after_success, expected) -> None:
    exp = make_experiment(bus={"embedded": {"replicas": 3, "afterSuccess": after_success}})
    sts = build_bus_statefulset(exp, finished=finished)
    assert shape(sts) == expected
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Delete"


def test_a_suspended_experiment_keeps_its_bus_volumes() -> None:
    assert shape(build_bus_statefulset(make_experiment(suspend=True))) == (0, "Retain")


def test_after_success_takes_only_delete_or_keep() -> None:
    with pytest.raises(ValueError, match="afterSuccess|after_success"):
        make_experiment(bus={"embedded": {"afterSuccess": "Forever"}})
