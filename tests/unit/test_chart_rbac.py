"""The chart's RBAC is least privilege in both install modes (issue 11, S1), and `replicaCount: 2` gives
one working replica, not two paused ones (B5): rendered offline with helm-python-sdk, the peering
decision taken by kopf's own code."""

from __future__ import annotations

import asyncio
import datetime as dt

import helm_python as helm  # kuberl[test]: a missing install fails, it is not skipped
import kopf
import kubernetes_validate
import pytest
from kopf._cogs.aiokits import aiotoggles
from kopf._core.engines import peering
from test_chart import CHART, KUBE_VERSION, NAMESPACE, granted, one, operator_rules, render

from kuberl.operator.leader import LEASE_NAME
from kuberl.operator.main import PEERING_MANDATORY_ENV, configure_settings, peering_priority

CLUSTER_SCOPED = {("", "nodes"), ("", "namespaces"), ("storage.k8s.io", "storageclasses"), ("apiextensions.k8s.io", "customresourcedefinitions"),
                  ("kopf.dev", "clusterkopfpeerings"), ("kueue.x-k8s.io", "resourceflavors"), ("kueue.x-k8s.io", "workloadpriorityclasses")}


def of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


class TestNamespacedInstall:
    VALUES = {"watchNamespaces": ["team-a", "team-b"]}

    def test_the_cluster_role_keeps_only_cluster_scoped_reads(self) -> None:
        rules = operator_rules(render(self.VALUES))
        assert {(g, r) for g, r, _ in granted(rules)} <= CLUSTER_SCOPED - {("kopf.dev", "clusterkopfpeerings")}
        assert {v for _, _, v in granted(rules)} <= {"get", "list", "watch"}

    def test_each_watched_namespace_gets_a_role_and_a_binding_to_the_operator(self) -> None:
        objects = render({**self.VALUES, "peering": {"enabled": True}, "leaderElection": {"enabled": False}})
        roles, bindings = of_kind(objects, "Role"), of_kind(objects, "RoleBinding")
        assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
        sa = one(objects, "ServiceAccount")["metadata"]["name"]
        for binding in bindings:
            assert binding["roleRef"]["kind"] == "Role"
            assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
        for role in roles:
            have = granted(role["rules"])
            assert ("kuberl.io", "rlexperiments", "watch") in have and ("kopf.dev", "kopfpeerings", "patch") in have
            assert not {(g, r) for g, r, _ in have} & CLUSTER_SCOPED
        for obj in objects:
            if obj["kind"] in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"):
                kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)

    def test_the_namespaced_rules_are_the_cluster_wide_ones(self) -> None:
        """One definition: what a Role grants in a watched namespace, the ClusterRole grants everywhere."""
        role = granted(of_kind(render(self.VALUES), "Role")[0]["rules"]) - {("kopf.dev", "kopfpeerings", v) for v in ("get", "list", "watch", "patch")}
        cluster = granted(operator_rules(render()))
        assert role <= cluster
        assert {(g, r, v) for g, r, v in cluster if (g, r) not in CLUSTER_SCOPED} == role


class TestLeastPrivilege:
    @pytest.mark.parametrize("values", [{}, {"watchNamespaces": ["team-a"]}], ids=["cluster-wide", "namespaced"])
    def test_secrets_are_get_create_patch_only_and_no_rbac_or_lease_rights(self, values) -> None:
        objects = render(values)
        roles = [o for o in objects if o["kind"] == "Role" and not o["metadata"]["name"].endswith("-leader-election")]
        have = granted(operator_rules(objects)) | set().union(*(granted(o["rules"]) for o in roles))
        assert {v for g, r, v in have if r == "secrets"} == {"get", "create", "patch"}
        assert not {g for g, _, _ in have} & {"rbac.authorization.k8s.io", "coordination.k8s.io"}
        assert not {r for _, r, _ in have} & {"statefulsets/scale", "leases", "roles", "rolebindings"}
        # Leases: only the leader-election Role, in the release namespace, get/update of its one Lease, create.
        election = one([o for o in objects if o["kind"] == "Role" and o["metadata"]["name"].endswith("-leader-election")], "Role")
        assert election["metadata"]["namespace"] == NAMESPACE
        assert sorted((tuple(r["verbs"]), tuple(r.get("resourceNames") or ())) for r in election["rules"]) == [
            (("create",), ()), (("get", "update"), (LEASE_NAME,))]


class TestReplicas:
    def test_two_replicas_get_distinct_priorities_from_their_pod_names(self) -> None:
        names = [f"kuberl-7d9f8c6b5-{s}" for s in ("abcde", "fghij", "klmno", "pqrst")]
        priorities = [peering_priority(n) for n in names]
        assert len(set(priorities)) == len(priorities) and all(p > 0 for p in priorities)
        assert peering_priority(names[0]) == priorities[0]  # stable across restarts of the same pod

    def test_the_deployment_passes_the_pod_name_and_makes_peering_mandatory_beyond_one(self) -> None:
        def env(values: dict) -> dict:
            c = one(render(values), "Deployment")["spec"]["template"]["spec"]["containers"][0]
            return {e["name"]: e for e in c["env"]}

        assert env({"replicaCount": 2})["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env({"replicaCount": 2})["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
        peering = {"replicaCount": 2, "peering": {"enabled": True}, "leaderElection": {"enabled": False}}
        assert env(peering)[PEERING_MANDATORY_ENV]["value"] == "true"
        assert PEERING_MANDATORY_ENV not in env({}) and PEERING_MANDATORY_ENV not in env({"replicaCount": 2})  # the Lease decides

    def test_more_than_one_replica_without_peering_is_refused(self) -> None:
        with helm.Chart.load(CHART) as chart:
            with pytest.raises(helm.HelmError) as err:
                chart.validate_schema(chart.merge_values({"replicaCount": 2, "leaderElection": {"enabled": False}}))
            assert "enabled" in str(err.value)
            chart.validate_schema(chart.merge_values({"replicaCount": 2}))  # leader election, the default
            chart.validate_schema(chart.merge_values({"replicaCount": 2, "leaderElection": {"enabled": False}, "peering": {"enabled": True}}))
            chart.validate_schema(chart.merge_values({"replicaCount": 1, "leaderElection": {"enabled": False}}))

    def test_kopf_pauses_exactly_one_of_two_replicas(self) -> None:
        """kopf's own peering decision, fed with both replicas' records as the peering object holds them."""
        pods = {"kuberl-7d9f8c6b5-abcde": "id-a", "kuberl-7d9f8c6b5-fghij": "id-b"}
        now = dt.datetime.now(dt.UTC).isoformat()
        records = {}
        settings_of = {}
        for pod, identity in pods.items():
            settings = kopf.OperatorSettings()
            configure_settings(settings, standalone=False, clusterwide=True, priority=peering_priority(pod), mandatory=True)
            settings_of[identity] = settings
            records[identity] = {"priority": settings.peering.priority, "lifetime": 60, "lastseen": now}
        event = {"type": "MODIFIED", "object": {"metadata": {"name": "kuberl"}, "status": records}}

        async def paused(identity: str) -> bool:
            conflicts = aiotoggles.Toggle(False)
            wake = asyncio.Event()
            wake.set()  # do not sleep until the peers' deadlines
            await peering.process_peering_event(raw_event=event, namespace=None, resource=None, identity=identity,
                                                settings=settings_of[identity], autoclean=False, stream_pressure=wake,
                                                conflicts_found=conflicts)
            return conflicts.is_on()

        decisions = {identity: asyncio.run(paused(identity)) for identity in pods.values()}
        assert sorted(decisions.values()) == [False, True], decisions


def test_notes_point_a_new_user_at_an_example_a_default_cluster_can_run() -> None:
    """NOTES.txt's first experiment must run on kind/minikube: no accelerator, no ReadWriteMany volume."""
    import re

    from test_chart import ROOT

    from kuberl.api import load_experiment
    from kuberl.operator.builders import checkpoint_access_mode
    from kuberl.operator.builders.common import accelerator_resource

    with helm.Chart.load(CHART) as chart:
        notes = next(text for path, text in chart.render({}, name="kuberl", namespace=NAMESPACE, is_install=True).items()
                     if path.endswith("NOTES.txt"))
    [example] = re.findall(r"kubectl apply -f (examples/\S+\.yaml)", notes)
    exp = load_experiment(ROOT / example)
    assert checkpoint_access_mode(exp) == "ReadWriteOnce"
    assert not any(accelerator_resource(a) for a in (exp.spec.rollout.accelerator, exp.spec.trainer.accelerator))
