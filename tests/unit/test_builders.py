"""Specification of the operator's pure builders: RLExperiment -> Kubernetes children.

Every child must pass kubernetes-validate (1.32, strict); selectors must match pod labels; a spec
change must touch only the children that depend on it; nothing secret may leave the Secret.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

import kuberl
from kuberl.api import RLExperiment, load_experiments
from kuberl.operator import labels as L
from kuberl.operator import naming
from kuberl.operator.builders import (
    build_bus_secret,
    build_bus_services,
    build_bus_statefulset,
    build_checkpoint_pvc,
    build_children,
    build_config_map,
    build_network_policy,
    build_rbac,
    build_rollout_service,
    build_rollout_statefulset,
    build_trainer_job,
    build_trainer_service,
    keep_immutable_fields,
    render_nats_conf,
)
from kuberl.runtime.bus.server import find_nats_server
from kuberl.testing.examples import experiment_files

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = experiment_files()
K8S_VERSION = "1.32"
TOKEN = "s3cr3t-Token_value"
ENGINE_KEY = "eng1ne-Key_value"

BASE: dict[str, Any] = {
    "apiVersion": "kuberl.io/v1alpha1",
    "kind": "RLExperiment",
    "metadata": {"name": "exp", "namespace": "team-a"},
    "spec": {
        "model": {"id": "Qwen/Qwen2.5-0.5B-Instruct"},
        "dataset": {"id": "openai/gsm8k", "config": "main"},
        "rollout": {"engine": "sglang", "replicas": 2, "accelerator": {"type": "nvidia", "count": 1}},
        "trainer": {"nodes": 1, "accelerator": {"type": "nvidia", "count": 2}},
        "training": {"totalSteps": 100},
    },
}


def make_experiment(name: str = "exp", namespace: str = "team-a", **overrides: Any) -> RLExperiment:
    """BASE with overrides: `rollout__replicas=3` sets spec.rollout.replicas; a None value deletes the key."""
    manifest = copy.deepcopy(BASE)
    manifest["metadata"] = {"name": name, "namespace": namespace}
    for dotted, value in overrides.items():
        *path, last = dotted.split("__")
        node = manifest["spec"]
        for key in path:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return RLExperiment.model_validate(manifest)


def by_key(children: list[dict]) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def containers(obj: dict) -> dict[str, dict]:
    return {c["name"]: c for c in obj["spec"]["template"]["spec"]["containers"]}


def env_of(container: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


IN_TEST = {
    "nvidia sglang": make_experiment(),
    "cpu vllm": make_experiment(rollout={"engine": "vllm", "accelerator": {"type": "cpu", "count": 0}}, trainer={"accelerator": {"type": "cpu", "count": 1}}),
    # The runtime-npu image has no inference engine: an Ascend rollout names an image with one.
    "ascend": make_experiment(rollout__image="registry.example/vllm-ascend:1", rollout__accelerator={"type": "ascend", "count": 1},
                              trainer__accelerator={"type": "ascend", "count": 8}),
    "allocation": make_experiment(rollout=None, trainer=None, allocation="sglang:d4t2+fsdp:d16"),
    "external bus": make_experiment(bus={"external": {"url": "nats://nats.nats.svc:4222", "credentialsSecret": {"name": "nats-creds"}}}),
    "bus sync, 3 NATS servers": make_experiment(weightSync={"mode": "bus"}, bus={"embedded": {"replicas": 3, "storage": "20Gi", "storageClassName": "fast"}}),
    "suspended": make_experiment(suspend=True),
    "volumes and hub token": make_experiment(
        model={"path": "qwen", "volume": {"claimName": "models", "subPath": "hf"}, "hubTokenSecret": {"name": "hf", "key": "token"}},
        dataset={"path": "gsm8k/train.jsonl", "volume": {"claimName": "data"}},
        checkpoint={"existingClaim": "shared-ckpt"},
    ),
    "scheduling": make_experiment(
        rollout__nodeSelector={"pool": "gpu"},
        rollout__tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        rollout__affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
        rollout__priorityClassName="high",
        rollout__resources={"requests": {"cpu": 4, "memory": "32Gi"}, "limits": {"memory": "40Gi"}},
        rollout__imagePullPolicy="Always",
        trainer__image="registry.example/trainer:1",
    ),
}


# Examples are loaded inside each test (not at collection), so one broken example fails its own
# cases only. Each case is (id, loader).
ALL_CASES = [(name, lambda exp=exp: [exp]) for name, exp in IN_TEST.items()] + [
    (f"examples/{path.name}", lambda path=path: load_experiments(path)) for path in EXAMPLES
]
CASE_IDS = [c for c, _ in ALL_CASES]


class TestEveryChildIsAValidKubernetesObject:
    @pytest.mark.parametrize("case,load", ALL_CASES, ids=CASE_IDS)
    def test_every_child_passes_strict_kubernetes_validation(self, case: str, load: Any) -> None:
        exps = load()
        assert exps, f"{case} holds no RLExperiment"
        for exp in exps:
            for child in build_children(exp, bus_token=TOKEN, engine_api_key=ENGINE_KEY):
                kubernetes_validate.validate(child, K8S_VERSION, strict=True)

    def test_the_strict_validation_used_here_rejects_an_unknown_field(self) -> None:
        sts = build_rollout_statefulset(make_experiment())
        sts["spec"]["template"]["spec"]["containers"][0]["gpuCount"] = 1
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(sts, K8S_VERSION, strict=True)

    def test_the_examples_folder_is_not_empty(self) -> None:
        assert EXAMPLES, "examples/*.yaml should hold RLExperiment manifests"

    @pytest.mark.parametrize("case,load", ALL_CASES, ids=CASE_IDS)
    def test_selectors_match_the_labels_of_the_pods_they_select(self, case: str, load: Any) -> None:
        children = [c for exp in load() for c in build_children(exp, bus_token=TOKEN)]
        pods = {c["metadata"]["name"]: c["spec"]["template"]["metadata"]["labels"] for c in children if c["kind"] in ("StatefulSet", "Job")}
        for child in children:
            if child["kind"] == "StatefulSet":
                assert child["spec"]["selector"]["matchLabels"].items() <= pods[child["metadata"]["name"]].items()
            if child["kind"] == "Service":
                selector = child["spec"]["selector"]
                assert any(selector.items() <= labels.items() for labels in pods.values()), child["metadata"]["name"]

    @pytest.mark.parametrize("case,load", ALL_CASES, ids=CASE_IDS)
    def test_children_live_in_the_experiments_namespace_with_its_labels_and_no_owner(self, case: str, load: Any) -> None:
        pairs = [(exp, child) for exp in load() for child in build_children(exp, bus_token=TOKEN)]
        for exp, child in pairs:
            meta = child["metadata"]
            assert meta["namespace"] == exp.namespace
            assert meta["labels"][L.EXPERIMENT_LABEL] == exp.name
            assert meta["labels"][L.APP_MANAGED_BY_LABEL] == L.MANAGED_BY
            assert "ownerReferences" not in meta  # the handlers adopt with kopf.adopt


class TestPurity:
    def test_building_twice_gives_equal_objects(self) -> None:
        for exp in IN_TEST.values():
            assert build_children(exp, bus_token=TOKEN) == build_children(exp, bus_token=TOKEN)

    def test_builders_ignore_the_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        exp = make_experiment()
        before = build_children(exp, bus_token=TOKEN)
        monkeypatch.setenv("KUBERL_BUS_URL", "nats://elsewhere:4222")
        monkeypatch.setenv("KUBERL_WORKDIR", "/tmp/x")
        assert build_children(exp, bus_token=TOKEN) == before

    def test_building_does_not_modify_the_experiment(self) -> None:
        exp = make_experiment(allocation="sglang:d2+fsdp:d2", rollout=None, trainer=None)
        before = exp.model_dump()
        build_children(exp, bus_token=TOKEN)
        assert exp.model_dump() == before

    def test_children_come_in_apply_order(self) -> None:
        kinds = [c["kind"] for c in build_children(make_experiment(), bus_token=TOKEN)]
        assert kinds.index("ServiceAccount") < kinds.index("StatefulSet")
        assert kinds.index("ConfigMap") < kinds.index("StatefulSet")
        assert kinds.index("Secret") < kinds.index("StatefulSet")
        assert kinds.index("PersistentVolumeClaim") < kinds.index("Job")
        assert kinds[-1] == "Job"

    def test_without_a_token_no_secret_is_built(self) -> None:
        assert "Secret" not in [c["kind"] for c in build_children(make_experiment())]


def _without_pinning_bookkeeping(obj: dict) -> dict:
    """The child without the record of which spec it was rendered for (builders.pinning stamps every
    pinned child with it; it changes with any spec field and rolls nothing)."""
    obj = copy.deepcopy(obj)
    for key in ("kuberl.io/template-inputs", "kuberl.io/template-generation"):
        obj["metadata"].get("annotations", {}).pop(key, None)
    return obj


def _changed(before: RLExperiment, after: RLExperiment) -> set[tuple[str, str]]:
    a, b = by_key(build_children(before, bus_token=TOKEN)), by_key(build_children(after, bus_token=TOKEN))
    assert a.keys() == b.keys()
    return {k for k in a if _without_pinning_bookkeeping(a[k]) != _without_pinning_bookkeeping(b[k])}


class TestChangingOneFieldChangesOnlyItsDependents:
    def test_rollout_replicas_changes_only_the_rollout_statefulset(self) -> None:
        assert _changed(make_experiment(), make_experiment(rollout__replicas=5)) == {("StatefulSet", "exp-rollout")}

    def test_rollout_tolerations_change_only_the_rollout_statefulset(self) -> None:
        after = make_experiment(rollout__tolerations=[{"key": "gpu", "operator": "Exists"}])
        assert _changed(make_experiment(), after) == {("StatefulSet", "exp-rollout")}

    def test_trainer_resources_change_only_the_trainer_job(self) -> None:
        after = make_experiment(trainer__resources={"requests": {"memory": "64Gi"}})
        assert _changed(make_experiment(), after) == {("Job", "exp-trainer")}

    def test_checkpoint_size_changes_only_the_pvc(self) -> None:
        assert _changed(make_experiment(), make_experiment(checkpoint={"size": "200Gi"})) == {("PersistentVolumeClaim", "exp-checkpoints")}

    def test_bus_storage_changes_only_the_bus_secret_and_statefulset(self) -> None:
        after = make_experiment(bus={"embedded": {"storage": "30Gi"}})
        assert _changed(make_experiment(), after) == {("StatefulSet", "exp-bus"), ("Secret", "exp-bus-credentials")}

    def test_a_training_setting_changes_the_config_and_restarts_the_pods_that_read_it(self) -> None:
        after = make_experiment(algorithm={"learningRate": 1e-6})
        assert _changed(make_experiment(), after) == {("ConfigMap", "exp-config"), ("StatefulSet", "exp-rollout"), ("Job", "exp-trainer")}

    def test_suspend_changes_only_the_workloads(self) -> None:
        assert _changed(make_experiment(), make_experiment(suspend=True)) == {
            ("StatefulSet", "exp-rollout"),
            ("StatefulSet", "exp-bus"),
            ("Job", "exp-trainer"),
        }

    def test_the_spec_hash_annotation_follows_the_content(self) -> None:
        a = build_rollout_statefulset(make_experiment())
        b = build_rollout_statefulset(make_experiment(rollout__replicas=3))
        assert a["metadata"]["annotations"][L.SPEC_HASH_ANNOTATION] != b["metadata"]["annotations"][L.SPEC_HASH_ANNOTATION]
        assert build_rollout_statefulset(make_experiment())["metadata"]["annotations"] == a["metadata"]["annotations"]


class TestConfigMap:
    def test_experiment_yaml_loads_back_as_the_same_runtime_config(self) -> None:
        exp = make_experiment(algorithm={"learningRate": 3e-6, "batchSize": 64}, staleness={"maxHeadOffpolicyness": 4})
        text = build_config_map(exp)["data"]["experiment.yaml"]
        loaded = RLExperiment.model_validate(yaml.safe_load(text))
        assert loaded.name == "exp" and loaded.namespace == "team-a"
        assert loaded.spec.algorithm == exp.spec.algorithm
        assert loaded.spec.staleness == exp.spec.staleness
        assert loaded.spec.model == exp.spec.model
        assert loaded.spec.trainer.accelerator == exp.spec.trainer.accelerator
        assert loaded.status is None

    def test_allocation_arrives_expanded(self) -> None:
        exp = make_experiment(rollout=None, trainer=None, allocation="vllm:d2t2+fsdp:d16")
        spec = yaml.safe_load(build_config_map(exp)["data"]["experiment.yaml"])["spec"]
        assert "allocation" not in spec
        assert spec["rollout"]["engine"] == "vllm" and spec["rollout"]["tensorParallelSize"] == 2
        assert spec["trainer"]["nodes"] == 2 and spec["trainer"]["accelerator"]["count"] == 8
        RLExperiment.model_validate(yaml.safe_load(build_config_map(exp)["data"]["experiment.yaml"]))

    def test_operator_only_fields_are_left_out(self) -> None:
        exp = IN_TEST["scheduling"]
        spec = yaml.safe_load(build_config_map(exp)["data"]["experiment.yaml"])["spec"]
        for field in ("replicas", "nodeSelector", "tolerations", "affinity", "priorityClassName", "resources", "imagePullPolicy"):
            assert field not in spec["rollout"], field
        assert "image" not in spec["trainer"]
        assert "suspend" not in spec and "failurePolicy" not in spec and "embedded" not in spec["bus"]

    def test_volume_paths_become_paths_under_their_mounts(self) -> None:
        exp = IN_TEST["volumes and hub token"]
        spec = yaml.safe_load(build_config_map(exp)["data"]["experiment.yaml"])["spec"]
        assert spec["model"]["path"] == "/models/models/qwen" and "volume" not in spec["model"]
        assert spec["dataset"]["path"] == "/data/data/gsm8k/train.jsonl"
        engine = containers(build_rollout_statefulset(exp))["engine"]
        assert {"name": "model", "mountPath": "/models/models", "readOnly": True, "subPath": "hf"} in engine["volumeMounts"]

    def test_no_secret_value_leaves_the_bus_secret(self) -> None:
        for exp in IN_TEST.values():
            for child in build_children(exp, bus_token=TOKEN, engine_api_key=ENGINE_KEY):
                if child["kind"] != "Secret":
                    assert TOKEN not in json.dumps(child), f"{child['kind']}/{child['metadata']['name']} carries the bus token"
                    assert ENGINE_KEY not in json.dumps(child), f"{child['kind']}/{child['metadata']['name']} carries the engine key"

    def test_the_hub_token_reaches_pods_only_by_reference(self) -> None:
        exp = IN_TEST["volumes and hub token"]
        env = env_of(containers(build_trainer_job(exp))["trainer"])
        assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
        assert "hubTokenSecret" in build_config_map(exp)["data"]["experiment.yaml"]  # a reference, not a value


class TestAccelerators:
    def test_nvidia_pods_request_and_limit_the_same_gpu_count(self) -> None:
        exp = make_experiment(rollout__tensorParallelSize=2, rollout__accelerator={"type": "nvidia", "count": 2})
        engine = containers(build_rollout_statefulset(exp))["engine"]
        assert engine["resources"]["requests"]["nvidia.com/gpu"] == engine["resources"]["limits"]["nvidia.com/gpu"] == "2"
        trainer = containers(build_trainer_job(exp))["trainer"]
        assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert "nvidia.com/gpu" not in containers(build_rollout_statefulset(exp))["rollout-agent"].get("resources", {}).get("limits", {})

    def test_ascend_pods_ask_for_ascend_npus_and_use_the_npu_image(self) -> None:
        exp = IN_TEST["ascend"]
        for obj, name in ((build_rollout_statefulset(exp), "engine"), (build_trainer_job(exp), "trainer")):
            c = containers(obj)[name]
            assert "huawei.com/Ascend910" in c["resources"]["limits"]
            assert c["resources"]["requests"]["huawei.com/Ascend910"] == c["resources"]["limits"]["huawei.com/Ascend910"]
            assert c["image"] == ("registry.example/vllm-ascend:1" if name == "engine" else f"ghcr.io/kuberl/runtime-npu:{kuberl.__version__}")
            assert "nvidia.com/gpu" not in json.dumps(c)
        assert containers(build_trainer_job(exp))["trainer"]["resources"]["limits"]["huawei.com/Ascend910"] == "8"

    def test_cpu_pods_ask_for_no_accelerator_and_use_the_cpu_image(self) -> None:
        exp = IN_TEST["cpu vllm"]
        engine = containers(build_rollout_statefulset(exp))["engine"]
        assert "nvidia.com/gpu" not in json.dumps(engine) and "Ascend" not in json.dumps(engine)
        assert engine["image"] == f"ghcr.io/kuberl/runtime-cpu:{kuberl.__version__}"

    def test_default_images_follow_the_engine(self) -> None:
        assert containers(build_rollout_statefulset(make_experiment()))["engine"]["image"] == f"ghcr.io/kuberl/runtime-sglang:{kuberl.__version__}"
        vllm = make_experiment(rollout__engine="vllm")
        assert containers(build_trainer_job(vllm))["trainer"]["image"] == f"ghcr.io/kuberl/runtime-vllm:{kuberl.__version__}"

    def test_an_image_in_the_spec_wins(self) -> None:
        assert containers(build_trainer_job(IN_TEST["scheduling"]))["trainer"]["image"] == "registry.example/trainer:1"

    def test_allocation_expands_into_replicas_and_accelerators_per_pod(self) -> None:
        exp = IN_TEST["allocation"]  # sglang:d4t2+fsdp:d16
        sts = build_rollout_statefulset(exp)
        assert sts["spec"]["replicas"] == 4
        assert containers(sts)["engine"]["resources"]["limits"]["nvidia.com/gpu"] == "2"
        job = build_trainer_job(exp)
        assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
        cmd = containers(job)["trainer"]["command"]
        assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--nproc-per-node") + 1] == "8"
        assert containers(job)["trainer"]["resources"]["limits"]["nvidia.com/gpu"] == "8"


class TestRollout:
    def test_each_pod_runs_the_engine_and_the_agent_with_the_contract_commands(self) -> None:
        c = containers(build_rollout_statefulset(make_experiment()))
        assert c["engine"]["command"] == ["kuberl", "engine", "--config", "/etc/kuberl/experiment.yaml", "--port", "8000"]
        assert c["rollout-agent"]["command"] == ["kuberl", "rollout", "--config", "/etc/kuberl/experiment.yaml"]

    def test_the_engine_is_probed_on_health_and_has_a_memory_backed_shm(self) -> None:
        sts = build_rollout_statefulset(make_experiment())
        engine = containers(sts)["engine"]
        for probe in ("startupProbe", "readinessProbe"):
            assert engine[probe]["httpGet"]["path"] == "/health"
        assert engine["ports"][0]["containerPort"] == 8000
        assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in sts["spec"]["template"]["spec"]["volumes"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]

    def test_the_agent_gets_engine_url_bus_and_its_pod_name(self) -> None:
        env = env_of(containers(build_rollout_statefulset(make_experiment()))["rollout-agent"])
        assert env["KUBERL_ENGINE_URL"] == "http://127.0.0.1:8000"
        assert env["KUBERL_BUS_URL"] == "nats://exp-bus.team-a.svc:4222"
        assert env["KUBERL_BUS_USER"] == "rollout" and "KUBERL_BUS_TOKEN" not in env
        assert env["KUBERL_BUS_PASSWORD"] == {"secretKeyRef": {"name": "exp-bus-credentials", "key": "rollout-password"}}
        assert env["KUBERL_AGENT_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["KUBERL_WORKDIR"] == "/checkpoints"

    def test_disk_sync_mounts_the_checkpoint_pvc_read_only(self) -> None:
        sts = build_rollout_statefulset(make_experiment())
        vol = next(v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "workdir")
        assert vol["persistentVolumeClaim"] == {"claimName": "exp-checkpoints", "readOnly": True}
        for c in containers(sts).values():
            assert {"name": "workdir", "mountPath": "/checkpoints", "readOnly": True} in c["volumeMounts"]

    def test_a_builtin_model_needs_a_writable_workdir_to_be_built_into(self) -> None:
        sts = build_rollout_statefulset(make_experiment(model={"builtin": "tiny-qwen2"}))
        vol = next(v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "workdir")
        assert vol["persistentVolumeClaim"] == {"claimName": "exp-checkpoints"}
        for c in containers(sts).values():
            assert {"name": "workdir", "mountPath": "/checkpoints", "readOnly": False} in c["volumeMounts"]

    def test_bus_sync_gives_the_pod_its_own_writable_workdir(self) -> None:
        sts = build_rollout_statefulset(IN_TEST["bus sync, 3 NATS servers"])
        vol = next(v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "workdir")
        assert vol == {"name": "workdir", "emptyDir": {}}
        assert {"name": "workdir", "mountPath": "/checkpoints", "readOnly": False} in containers(sts)["rollout-agent"]["volumeMounts"]

    def test_the_replicas_argument_overrides_the_spec(self) -> None:
        assert build_rollout_statefulset(make_experiment(), replicas=7)["spec"]["replicas"] == 7
        assert build_rollout_statefulset(make_experiment())["spec"]["replicas"] == 2

    def test_a_negative_replica_count_is_refused(self) -> None:
        with pytest.raises(ValueError, match="replicas must be >= 0"):
            build_rollout_statefulset(make_experiment(), replicas=-1)

    def test_pods_start_in_parallel_and_carry_scheduling_fields(self) -> None:
        sts = build_rollout_statefulset(IN_TEST["scheduling"])
        pod = sts["spec"]["template"]["spec"]
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        assert pod["nodeSelector"] == {"pool": "gpu"} and pod["priorityClassName"] == "high"
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu" and "nodeAffinity" in pod["affinity"]
        engine = containers(sts)["engine"]
        assert engine["resources"]["requests"]["memory"] == "32Gi" and engine["imagePullPolicy"] == "Always"

    def test_the_headless_service_names_the_engine_pods(self) -> None:
        svc = build_rollout_service(make_experiment())
        assert svc["spec"]["clusterIP"] == "None" and svc["metadata"]["name"] == build_rollout_statefulset(make_experiment())["spec"]["serviceName"]


class TestTrainer:
    def test_the_command_is_the_contracts_torchrun_line(self) -> None:
        exp = make_experiment(trainer={"nodes": 2, "accelerator": {"type": "nvidia", "count": 8}})
        cmd = " ".join(containers(build_trainer_job(exp))["trainer"]["command"])
        assert cmd == (
            "python -m kuberl.runtime.trainer.torchrun --nnodes 2 --nproc-per-node 8 --node-rank $(JOB_COMPLETION_INDEX) --rdzv-backend static "
            "--master-addr exp-trainer-0.exp-trainer --master-port 29500 --no-python kuberl trainer --config /etc/kuberl/experiment.yaml"
        )

    def test_the_torchrun_module_of_the_command_exists_in_the_runtime(self) -> None:
        """Plain torchrun exits 1 whatever its ranks exit with; the runtime's wrapper passes exit 2 on."""
        import importlib.util

        command = containers(build_trainer_job(make_experiment()))["trainer"]["command"]
        assert command[:2] == ["python", "-m"] and importlib.util.find_spec(command[2]) is not None

    def test_a_configuration_error_fails_the_job_at_once_by_its_pod_failure_policy(self) -> None:
        job = build_trainer_job(make_experiment(trainer={"nodes": 2, "accelerator": {"type": "nvidia", "count": 8}}))
        rules = job["spec"]["podFailurePolicy"]["rules"]
        assert rules == [{"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [2]}}]
        assert rules[0]["onExitCodes"]["containerName"] in containers(job)
        # podFailurePolicy requires restartPolicy Never; other failures still count against backoffLimit 0
        # (the operator restarts the whole Job): no Ignore rule for disruptions.
        assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] == 0
        assert not any(r["action"] == "Ignore" or "onPodConditions" in r for r in rules)

    @pytest.mark.parametrize("case,load", ALL_CASES, ids=CASE_IDS)
    def test_every_runtime_container_falls_back_to_its_log_for_a_termination_message(self, case: str, load: Any) -> None:
        for exp in load():
            for workload in (build_trainer_job(exp), build_rollout_statefulset(exp)):
                for name, container in containers(workload).items():
                    assert container.get("terminationMessagePolicy") == "FallbackToLogsOnError", f"{case}: {name}"
                    assert "terminationMessagePath" not in container  # the default, /dev/termination-log (contracts.md)

    def test_the_job_is_indexed_with_one_pod_per_node_and_no_retries_of_its_own(self) -> None:
        job = build_trainer_job(make_experiment(trainer={"nodes": 3, "accelerator": {"type": "nvidia", "count": 1}}))
        spec = job["spec"]
        assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 3
        assert spec["backoffLimit"] == 0 and spec["template"]["spec"]["restartPolicy"] == "Never"
        assert spec["suspend"] is False

    def test_pod_dns_works_through_the_headless_service(self) -> None:
        exp = make_experiment()
        job, svc = build_trainer_job(exp), build_trainer_service(exp)
        assert job["spec"]["template"]["spec"]["subdomain"] == svc["metadata"]["name"] == "exp-trainer"
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
        assert svc["spec"]["ports"][0]["port"] == 29500
        assert svc["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()

    def test_the_checkpoint_pvc_is_mounted_read_write(self) -> None:
        job = build_trainer_job(make_experiment())
        trainer = containers(job)["trainer"]
        assert {"name": "checkpoints", "mountPath": "/checkpoints"} in trainer["volumeMounts"]
        vol = next(v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "checkpoints")
        assert vol["persistentVolumeClaim"] == {"claimName": "exp-checkpoints"}
        assert env_of(trainer)["KUBERL_WORKDIR"] == "/checkpoints"

    def test_an_existing_claim_replaces_the_operators_pvc(self) -> None:
        exp = IN_TEST["volumes and hub token"]
        assert build_checkpoint_pvc(exp) is None
        vol = next(v for v in build_trainer_job(exp)["spec"]["template"]["spec"]["volumes"] if v["name"] == "checkpoints")
        assert vol["persistentVolumeClaim"]["claimName"] == "shared-ckpt"
        assert "PersistentVolumeClaim" not in [c["kind"] for c in build_children(exp, bus_token=TOKEN)]


class TestSuspend:
    def test_a_suspended_experiment_keeps_a_suspended_job_and_no_running_pods(self) -> None:
        exp = IN_TEST["suspended"]
        assert build_trainer_job(exp)["spec"]["suspend"] is True
        assert build_rollout_statefulset(exp)["spec"]["replicas"] == 0
        assert build_rollout_statefulset(exp, replicas=4)["spec"]["replicas"] == 0  # suspend wins over the autoscaler
        assert build_bus_statefulset(exp)["spec"]["replicas"] == 0

    def test_suspending_keeps_the_bus_volumes(self) -> None:
        policy = build_bus_statefulset(IN_TEST["suspended"])["spec"]["persistentVolumeClaimRetentionPolicy"]
        assert policy == {"whenDeleted": "Delete", "whenScaled": "Retain"}


class TestBus:
    def test_an_external_bus_builds_no_bus_objects(self) -> None:
        exp = IN_TEST["external bus"]
        kinds = {(c["kind"], c["metadata"]["name"]) for c in build_children(exp, bus_token=TOKEN)}
        assert not {k for k in kinds if "bus" in k[1]}
        assert build_network_policy(exp) is None
        with pytest.raises(ValueError, match="spec.bus.external is set"):
            build_bus_statefulset(exp)

    def test_with_an_external_bus_pods_get_its_url_and_credentials_secret(self) -> None:
        exp = IN_TEST["external bus"]
        env = env_of(containers(build_rollout_statefulset(exp))["rollout-agent"])
        assert env["KUBERL_BUS_URL"] == "nats://nats.nats.svc:4222"
        assert env["KUBERL_BUS_TOKEN"] == {"secretKeyRef": {"name": "nats-creds", "key": "token"}}
        no_creds = make_experiment(bus={"external": {"url": "nats://nats:4222"}})
        assert "KUBERL_BUS_TOKEN" not in env_of(containers(build_trainer_job(no_creds))["trainer"])

    def test_the_nats_statefulset_is_probed_non_root_and_stores_on_its_own_volume(self) -> None:
        sts = build_bus_statefulset(IN_TEST["bus sync, 3 NATS servers"])
        nats = containers(sts)["nats"]
        assert nats["image"] == "nats:2.15-alpine"
        assert nats["livenessProbe"]["httpGet"]["path"] == "/healthz?js-enabled-only=true"
        assert nats["readinessProbe"]["httpGet"]["path"] == "/healthz?js-enabled-only=true"
        pod = sts["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and nats["securityContext"]["allowPrivilegeEscalation"] is False
        claim = sts["spec"]["volumeClaimTemplates"][0]["spec"]
        assert claim["resources"]["requests"]["storage"] == "20Gi" and claim["storageClassName"] == "fast"
        assert sts["spec"]["replicas"] == 3 and sts["spec"]["serviceName"] == "exp-bus-headless"

    def test_the_secret_holds_the_token_a_password_per_role_and_a_config_with_users_and_max_payload(self) -> None:
        secret = build_bus_secret(make_experiment(bus={"maxPayload": "4Mi"}), TOKEN)
        assert secret["stringData"]["token"] == TOKEN
        conf = secret["stringData"]["nats.conf"]
        assert "users = [" in conf and "token:" not in conf and "max_payload: 4194304" in conf and "jetstream {" in conf
        for role in ("trainer", "rollout", "operator"):
            assert f'"user": "{role}", "password": "{secret["stringData"][f"{role}-password"]}"' in conf
        assert "cluster {" not in conf  # one server: no routes

    def test_three_servers_get_routes_to_each_other(self) -> None:
        conf = render_nats_conf(IN_TEST["bus sync, 3 NATS servers"], TOKEN)
        for i in range(3):
            assert f'"nats://exp-bus-{i}.exp-bus-headless.team-a.svc:6222"' in conf

    @pytest.mark.parametrize("case", ["nvidia sglang", "bus sync, 3 NATS servers"])
    def test_nats_server_accepts_the_rendered_config(self, case: str, tmp_path: Path) -> None:
        conf = render_nats_conf(IN_TEST[case], TOKEN).replace("/data/jetstream", str(tmp_path / "js")).replace("/var/run/nats", str(tmp_path))
        (tmp_path / "nats.conf").write_text(conf)
        result = subprocess.run([find_nats_server(), "-t", "-c", str(tmp_path / "nats.conf")], check=False, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr

    def test_a_payload_limit_above_what_nats_allows_is_refused_by_field(self) -> None:
        with pytest.raises(ValueError, match="spec.bus.maxPayload"):
            render_nats_conf(make_experiment(bus={"maxPayload": "100Mi"}), TOKEN)

    def test_a_token_that_would_break_the_config_is_refused(self) -> None:
        with pytest.raises(ValueError, match="bus token"):
            build_bus_secret(make_experiment(), 'a"b')

    def test_the_client_service_and_the_headless_service(self) -> None:
        client, headless = build_bus_services(make_experiment())
        assert client["metadata"]["name"] == "exp-bus" and client["spec"]["ports"][0]["port"] == 4222
        assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
        assert {p["port"] for p in headless["spec"]["ports"]} == {4222, 6222, 8222}

    def test_the_bus_config_hash_changes_with_the_config_but_not_the_token(self) -> None:
        a = build_bus_statefulset(make_experiment())["spec"]["template"]["metadata"]["annotations"][L.BUS_CONFIG_HASH_ANNOTATION]
        b = build_bus_statefulset(make_experiment(bus={"maxPayload": "2Mi"}))["spec"]["template"]["metadata"]["annotations"][L.BUS_CONFIG_HASH_ANNOTATION]
        assert a != b


class TestNetworkPolicy:
    def test_only_this_experiments_pods_and_the_operator_reach_the_bus_client_port(self) -> None:
        policy = build_network_policy(make_experiment())
        assert policy["spec"]["podSelector"]["matchLabels"] == {L.EXPERIMENT_LABEL: "exp", L.ROLE_LABEL: "bus"}
        client_rule = next(r for r in policy["spec"]["ingress"] if r["ports"] == [{"protocol": "TCP", "port": 4222}])
        assert {"podSelector": {"matchLabels": {L.EXPERIMENT_LABEL: "exp"}}} in client_rule["from"]
        assert any(f.get("podSelector", {}).get("matchLabels") == L.OPERATOR_POD_LABELS for f in client_rule["from"])
        cluster_rule = next(r for r in policy["spec"]["ingress"] if r["ports"] == [{"protocol": "TCP", "port": 6222}])
        assert cluster_rule["from"] == [{"podSelector": {"matchLabels": {L.EXPERIMENT_LABEL: "exp", L.ROLE_LABEL: "bus"}}}]


class TestStorage:
    @pytest.mark.parametrize(
        "overrides,mode",
        [
            ({}, "ReadWriteMany"),  # disk sync: trainer writes, engines read
            ({"weightSync": {"mode": "bus"}}, "ReadWriteOnce"),
            ({"weightSync": {"mode": "bus"}, "trainer": {"nodes": 2, "accelerator": {"type": "nvidia", "count": 1}}}, "ReadWriteMany"),
        ],
        ids=["disk sync", "bus sync", "bus sync, two trainer nodes"],
    )
    def test_the_access_mode_follows_who_shares_the_volume(self, overrides: dict, mode: str) -> None:
        pvc = build_checkpoint_pvc(make_experiment(**overrides))
        assert pvc["spec"]["accessModes"] == [mode]

    def test_size_and_storage_class_come_from_the_spec(self) -> None:
        pvc = build_checkpoint_pvc(make_experiment(checkpoint={"size": "123Gi", "storageClassName": "nfs"}))
        assert pvc["spec"]["resources"]["requests"]["storage"] == "123Gi" and pvc["spec"]["storageClassName"] == "nfs"


class TestRBAC:
    def test_the_runtime_pods_get_a_token_less_account_and_no_role(self) -> None:
        [account] = build_rbac(make_experiment())
        assert account["kind"] == "ServiceAccount" and account["automountServiceAccountToken"] is False
        kinds = {c["kind"] for c in build_children(make_experiment(), bus_token=TOKEN)}
        assert not kinds & {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}

    @pytest.mark.parametrize("case,exp", list(IN_TEST.items()), ids=list(IN_TEST))
    def test_no_pod_mounts_an_api_token_or_may_escalate(self, case: str, exp: RLExperiment) -> None:
        for child in build_children(exp, bus_token=TOKEN):
            if child["kind"] in ("StatefulSet", "Job"):
                pod = child["spec"]["template"]["spec"]
                assert pod["automountServiceAccountToken"] is False
                assert pod["serviceAccountName"] == "exp-runtime"
                for c in pod["containers"]:
                    assert c["securityContext"]["allowPrivilegeEscalation"] is False
                    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}

    def test_pods_run_as_non_root_ascend_too_with_the_images_own_user(self) -> None:
        assert build_trainer_job(make_experiment())["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
        ascend = build_trainer_job(IN_TEST["ascend"])["spec"]["template"]["spec"]["securityContext"]
        assert ascend["runAsNonRoot"] is True and "runAsUser" not in ascend


class TestNaming:
    def test_children_are_named_after_the_experiment(self) -> None:
        names = {k for k in by_key(build_children(make_experiment(), bus_token=TOKEN))}
        assert names == {
            ("ServiceAccount", "exp-runtime"),
            ("ConfigMap", "exp-config"), ("Secret", "exp-bus-credentials"), ("PersistentVolumeClaim", "exp-checkpoints"),
            ("Service", "exp-bus"), ("Service", "exp-bus-headless"), ("NetworkPolicy", "exp-bus"), ("StatefulSet", "exp-bus"),
            ("Service", "exp-rollout"), ("NetworkPolicy", "exp-rollout"), ("StatefulSet", "exp-rollout"),
            ("Service", "exp-trainer"), ("NetworkPolicy", "exp-trainer"), ("PodDisruptionBudget", "exp-trainer"), ("Job", "exp-trainer"),
        }  # fmt: skip

    def test_the_longest_allowed_name_still_gives_valid_distinct_children(self) -> None:
        long_a, long_b = "a" * 51 + "x", "a" * 51 + "y"
        exp = make_experiment(name=long_a)
        for child in build_children(exp, bus_token=TOKEN):
            kubernetes_validate.validate(child, K8S_VERSION, strict=True)
        assert len(naming.rollout_name(long_a)) <= naming.STATEFULSET_NAME_MAX
        assert len(naming.bus_headless_name(long_a)) <= naming.SERVICE_NAME_MAX
        assert len(naming.trainer_name(long_a)) + len("-1023") <= 63
        assert naming.rollout_name(long_a) != naming.rollout_name(long_b)
        assert naming.rollout_name(long_a) == naming.rollout_name(long_a)

    def test_names_accept_a_model_a_body_or_a_plain_name(self) -> None:
        exp = make_experiment()
        assert naming.trainer_name(exp) == naming.trainer_name(exp.to_manifest()) == naming.trainer_name("exp") == "exp-trainer"
        assert naming.bus_url(exp) == naming.bus_url("exp", "team-a") == "nats://exp-bus.team-a.svc:4222"
        assert naming.bus_url(IN_TEST["external bus"]) == "nats://nats.nats.svc:4222"
        with pytest.raises(ValueError, match="namespace"):
            naming.bus_url("exp")


class TestImmutableFields:
    def live(self, obj: dict) -> dict:
        """`obj` as the API returns it: server defaults and status added."""
        live = copy.deepcopy(obj)
        live["metadata"]["uid"] = "1234"
        live["status"] = {"replicas": 1}
        for claim in live["spec"].get("volumeClaimTemplates", []):
            claim["spec"]["volumeMode"] = "Filesystem"
            claim["status"] = {"phase": "Pending"}
        return live

    def test_an_unchanged_child_passes_through_untouched(self) -> None:
        sts = build_bus_statefulset(make_experiment())
        assert keep_immutable_fields(sts, self.live(sts)) == (sts, [])
        assert keep_immutable_fields(sts, None) == (sts, [])

    def test_new_bus_storage_keeps_the_live_volume_claim_templates_and_says_so(self) -> None:
        live = self.live(build_bus_statefulset(make_experiment()))
        wanted = build_bus_statefulset(make_experiment(bus={"embedded": {"storage": "99Gi"}, "maxPayload": "2Mi"}))
        merged, notes = keep_immutable_fields(wanted, live)
        assert merged["spec"]["volumeClaimTemplates"] == live["spec"]["volumeClaimTemplates"]
        assert merged["spec"]["template"] == wanted["spec"]["template"]  # mutable parts still change
        assert len(notes) == 1 and "volumeClaimTemplates" in notes[0] and "99Gi" in notes[0]

    def test_a_pvc_keeps_its_access_mode_and_never_shrinks_but_may_grow(self) -> None:
        live = self.live(build_checkpoint_pvc(make_experiment(checkpoint={"size": "100Gi"})))
        smaller = build_checkpoint_pvc(make_experiment(weightSync={"mode": "bus"}, checkpoint={"size": "50Gi"}))
        merged, notes = keep_immutable_fields(smaller, live)
        assert merged["spec"]["accessModes"] == ["ReadWriteMany"] and merged["spec"]["resources"]["requests"]["storage"] == "100Gi"
        assert len(notes) == 2
        bigger = build_checkpoint_pvc(make_experiment(checkpoint={"size": "200Gi"}))
        assert keep_immutable_fields(bigger, live)[0]["spec"]["resources"]["requests"]["storage"] == "200Gi"

    def test_what_the_api_server_defaulted_is_kept_without_a_note(self) -> None:
        """A real API server fills PVC volumeMode and (DefaultStorageClass) storageClassName: not a change."""
        pvc = build_checkpoint_pvc(make_experiment())
        assert "volumeMode" not in pvc["spec"] and "storageClassName" not in pvc["spec"]
        live = self.live(pvc)
        live["spec"] |= {"volumeMode": "Filesystem", "storageClassName": "standard-rwx"}
        merged, notes = keep_immutable_fields(pvc, live)
        assert notes == []
        assert merged["spec"]["volumeMode"] == "Filesystem" and merged["spec"]["storageClassName"] == "standard-rwx"
        named = build_checkpoint_pvc(make_experiment(checkpoint={"storageClassName": "premium"}))
        assert len(keep_immutable_fields(named, live)[1]) == 1, "a class the spec names and the PVC lacks is a change"


class TestRuntimeImageRepository:
    """The operator's runtime image repository (KUBERL_RUNTIME_IMAGE_REPOSITORY, read once by
    `kuberl operator`): one value moves every default image to a mirror; explicit images stay."""

    MIRROR = "europe-docker.pkg.dev/my-project/kuberl"

    @pytest.fixture
    def mirror(self):
        from kuberl.operator.builders import common

        assert common.configure_images(self.MIRROR) == self.MIRROR
        try:
            yield self.MIRROR
        finally:
            common.configure_images(None)

    @staticmethod
    def images(exp: RLExperiment) -> dict[str, str]:
        out = {}
        for obj in (build_rollout_statefulset(exp), build_trainer_job(exp)):
            for name, c in containers(obj).items():
                out[name] = c["image"]
        return out

    @pytest.mark.parametrize("case,flavour", [("nvidia sglang", "sglang"), ("cpu vllm", "cpu"), ("ascend", "npu")])
    def test_default_images_come_from_the_configured_repository(self, mirror, case, flavour) -> None:
        trainer = self.images(IN_TEST[case])["trainer"]
        assert trainer == f"{mirror}/runtime-{flavour}:{kuberl.__version__}"

    def test_every_runtime_container_of_every_child_uses_it(self, mirror) -> None:
        for obj in build_children(make_experiment(rollout__engine="vllm"), bus_token=TOKEN):
            for c in (obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or []):
                if "runtime-" in c["image"]:
                    assert c["image"].startswith(f"{mirror}/runtime-vllm:"), (obj["kind"], c["name"], c["image"])

    def test_an_image_in_the_spec_still_wins(self, mirror) -> None:
        assert self.images(IN_TEST["scheduling"])["trainer"] == "registry.example/trainer:1"

    def test_unset_or_empty_means_ghcr(self) -> None:
        from kuberl.operator.builders import common

        for value in (None, "", "  "):
            assert common.configure_images(value) == "ghcr.io/kuberl"
            assert self.images(make_experiment())["engine"] == f"ghcr.io/kuberl/runtime-sglang:{kuberl.__version__}"

    @pytest.mark.parametrize("bad", ["ghcr.io/kuberl:0.1.0", "ghcr.io/kuberl@sha256:0123", "Registry.example.com/KubeRL", "https://ghcr.io/kuberl"])
    def test_a_repository_with_a_tag_or_bad_characters_is_refused_and_changes_nothing(self, bad) -> None:
        from kuberl.operator.builders import common
        from kuberl.operator.main import (
            RUNTIME_IMAGE_REPOSITORY_ENV,
            configure_runtime_images,
        )

        with pytest.raises(ValueError, match=RUNTIME_IMAGE_REPOSITORY_ENV):
            configure_runtime_images({RUNTIME_IMAGE_REPOSITORY_ENV: bad})
        assert common.IMAGE_REPOSITORY == "ghcr.io/kuberl"

    def test_a_trailing_slash_is_dropped(self) -> None:
        from kuberl.operator.builders import common

        try:
            assert common.configure_images(self.MIRROR + "/") == self.MIRROR
        finally:
            common.configure_images(None)
