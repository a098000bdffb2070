"""What multi-node fabrics ask of a role's pods (issue #38.5): native sidecars, allow-listed capabilities and extended
resources on the main container, the /dev/shm size (spec.<role>.podTemplate; builders/pod.py apply_fabric). The
restricted defaults stay wherever nothing is asked; the GKE TCPXO and EKS EFA examples render as their clouds' docs ask."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
from pydantic import ValidationError
from test_pod_overrides import experiment, pod
from test_pod_security import restricted_violations

from kuberl.api.loading import load_documents
from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator.builders import build_children, build_rollout_statefulset, build_trainer_job

ROOT = Path(__file__).resolve().parents[2]
RESTRICTED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
EFA = {"capabilities": ["IPC_LOCK"], "extendedResources": {"vpc.amazonaws.com/efa": 32, "hugepages-2Mi": "5120Mi"}, "shmSizeLimit": "64Gi"}
DAEMON = {"name": "tcpxo-daemon", "image": "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/tcpgpudmarxd-dev:v1.0.14",
          "command": ["/bin/sh", "-c"], "args": ["/fts/entrypoint_rxdm_container.sh --num_hops=2 --num_nics=8 --uid="],
          "env": [{"name": "LD_LIBRARY_PATH", "value": "/usr/local/nvidia/lib64"}],
          "volumeMounts": [{"name": "sys", "mountPath": "/hostsysfs"}],
          "resources": {"requests": {"cpu": "150m", "memory": "1Gi"}},
          "capabilities": ["NET_ADMIN", "NET_BIND_SERVICE"], "runAsUser": 0}


def with_memory(role: str, override: dict) -> RLExperiment:
    """experiment() with `override` as `role`'s podTemplate and a memory request (hugepages need one)."""
    doc = experiment().model_dump(by_alias=True, exclude_none=True, mode="json")
    doc["spec"][role] |= {"podTemplate": override, "resources": {"requests": {"memory": "32Gi"}}}
    return RLExperiment.model_validate(doc)


def containers(obj: dict) -> dict[str, dict]:
    spec = pod(obj)["spec"]
    return {c["name"]: c for c in [*spec.get("initContainers", []), *spec["containers"]]}


def test_without_fabric_fields_every_container_keeps_the_restricted_context() -> None:
    exp = experiment({"env": [{"name": "NCCL_DEBUG", "value": "INFO"}]}, {"labels": {"team": "a"}})
    for obj in (build_trainer_job(exp), build_rollout_statefulset(exp)):
        spec = pod(obj)["spec"]
        assert "initContainers" not in spec
        assert all(c["securityContext"] == RESTRICTED for c in spec["containers"])
        assert next(v for v in spec["volumes"] if v["name"] == "dshm") == {"name": "dshm", "emptyDir": {"medium": "Memory"}}
        assert restricted_violations(spec) == []


def test_efa_capability_and_resources_go_to_the_main_container_only() -> None:
    exp = with_memory("rollout", EFA)
    c = containers(build_rollout_statefulset(exp))
    engine, agent = c["engine"], c["rollout-agent"]
    assert engine["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}
    for part in ("requests", "limits"):  # requests == limits, as the API server requires of both kinds
        assert engine["resources"][part]["vpc.amazonaws.com/efa"] == "32"
        assert engine["resources"][part]["hugepages-2Mi"] == "5120Mi"
    assert agent["securityContext"] == RESTRICTED
    assert "vpc.amazonaws.com/efa" not in str(agent.get("resources"))
    dshm = next(v for v in pod(build_rollout_statefulset(exp))["spec"]["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert containers(build_trainer_job(exp))["trainer"]["securityContext"] == RESTRICTED  # the other role is untouched


def test_the_main_containers_own_requests_stay_beside_the_extended_ones() -> None:
    exp = experiment({"extendedResources": {"vpc.amazonaws.com/efa": 4}})
    resources = containers(build_trainer_job(exp))["trainer"]["resources"]
    assert resources["limits"] == {"nvidia.com/gpu": "1", "vpc.amazonaws.com/efa": "4"}
    assert resources["requests"]["nvidia.com/gpu"] == "1"


def test_a_sidecar_is_a_native_sidecar_with_only_its_own_capabilities() -> None:
    exp = experiment({"sidecars": [DAEMON], "volumes": [{"name": "sys", "hostPath": {"path": "/sys"}}]})
    c = containers(build_trainer_job(exp))
    daemon = c["tcpxo-daemon"]
    assert pod(build_trainer_job(exp))["spec"]["initContainers"] == [daemon]
    assert daemon["restartPolicy"] == "Always"
    assert daemon["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_BIND_SERVICE"]},
                                         "runAsUser": 0, "runAsNonRoot": False}
    assert daemon["args"] == DAEMON["args"] and daemon["env"] == DAEMON["env"] and daemon["volumeMounts"] == DAEMON["volumeMounts"]
    assert daemon["resources"] == {"requests": {"cpu": "150m", "memory": "1Gi"}}
    assert c["trainer"]["securityContext"] == RESTRICTED  # the daemon's capabilities are its own
    # Pod Security names what the tenant asked for, and nothing the operator added.
    assert sorted(restricted_violations(pod(build_trainer_job(exp))["spec"])) == sorted([
        "volume sys: type hostPath is not allowed", "tcpxo-daemon: runAsNonRoot is not true", "tcpxo-daemon: runAsUser 0",
        "tcpxo-daemon: adds capabilities ['NET_ADMIN', 'NET_BIND_SERVICE']"])


def test_a_sidecar_without_a_user_runs_as_the_pods() -> None:
    c = containers(build_trainer_job(experiment({"sidecars": [{"name": "log-shipper", "image": "fluent-bit:3"}]})))
    assert c["log-shipper"] == {"name": "log-shipper", "image": "fluent-bit:3", "restartPolicy": "Always", "securityContext": RESTRICTED,
                                "terminationMessagePolicy": "FallbackToLogsOnError"}


@pytest.mark.parametrize("override, needle", [
    ({"capabilities": ["SYS_ADMIN"]}, "SYS_ADMIN and every other capability are refused"),
    ({"capabilities": ["CAP_IPC_LOCK"]}, "without the CAP_ prefix"),
    ({"sidecars": [{"name": "d", "image": "i", "capabilities": ["SYS_PTRACE"]}]}, "may add only IPC_LOCK, NET_ADMIN and NET_BIND_SERVICE"),
    ({"sidecars": [{"name": "engine", "image": "i"}]}, "not engine, rollout-agent or trainer"),
    ({"sidecars": [{"name": "d", "image": "i", "privileged": True}]}, "privileged"),  # no field for it: refused as unknown
    ({"extendedResources": {"cpu": 4}}, "cpu and memory belong in resources"),
    ({"extendedResources": {"kubernetes.io/foo": 1}}, "extended resources"),
    ({"extendedResources": {"hugepages-2Mi": "1Gi"}}, "hugepages need a cpu or memory"),
    ({"shmSizeLimit": "lots"}, "not a Kubernetes quantity"),
])
def test_what_the_fabrics_do_not_need_is_refused_naming_it(override: dict, needle: str) -> None:
    with pytest.raises(ValidationError, match=needle.replace("(", r"\(")):
        experiment(override)


@pytest.mark.parametrize("name", ["gke-a3-tcpxo.yaml", "eks-p5-efa.yaml"])
def test_the_fabric_examples_render_valid_pods_as_their_clouds_ask(name: str) -> None:
    [doc] = [d for d in load_documents(ROOT / "examples" / name) if d.get("kind") == "RLExperiment"]
    doc["metadata"]["namespace"] = "rl"
    exp = RLExperiment.model_validate(doc)
    for child in build_children(exp):
        kubernetes_validate.validate(child, "1.32", strict=True)
    job = build_trainer_job(exp)
    c = containers(job)
    assert job["spec"]["completions"] == exp.spec.trainer.nodes >= 2
    if name.startswith("gke"):
        annotations = pod(job)["metadata"]["annotations"]
        assert "tcpxo-daemon" in c and c["tcpxo-daemon"]["restartPolicy"] == "Always"
        assert "/dev/dmabuf_import_helper" in annotations["devices.gke.io/container.tcpxo-daemon"]
        assert '"vpc8"' in annotations["networking.gke.io/interfaces"]
        env = {e["name"]: e.get("value") for e in c["trainer"]["env"]}
        assert env["LD_LIBRARY_PATH"].startswith("/usr/local/nvidia/lib64") and env["NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY"] == "/dev/aperture_devices"
    else:
        trainer = c["trainer"]
        assert trainer["resources"]["limits"]["vpc.amazonaws.com/efa"] == "32"
        assert trainer["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert {e["name"] for e in trainer["env"]} >= {"FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA"}
