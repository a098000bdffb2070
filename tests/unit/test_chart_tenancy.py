"""Least privilege for a shared cluster (issue #38.1), rendered offline: the default install writes nothing in a
namespace that no RoleBinding opens, the operator's own check (kuberl.operator.access) asks for exactly what the
chart grants there, tenants get aggregated view/edit roles, and the admission policy carries the values. The same
objects on the real API server: tests/integration/test_tenancy.py."""

from __future__ import annotations

import helm_python as helm  # kuberl[test]: a missing install fails, it is not skipped
import pytest
from test_chart import CHART, NAMESPACE, granted, one, render

from kuberl.operator import access

SA = {"kind": "ServiceAccount", "name": "kuberl", "namespace": NAMESPACE}
# What the operator may do in every namespace beyond reading: its own custom resource, Events, Kueue Workloads.
CLUSTER_WIDE_WRITES = {"rlexperiments", "rlexperiments/status", "rlexperiments/scale", "rlexperiments/finalizers",
                       "events", "workloads", "workloads/status", "clusterkopfpeerings"}


def cluster_wide_grants(objects: list[dict]) -> set[tuple[str, str, str]]:
    """What the operator's ServiceAccount holds in every namespace: the ClusterRoles its ClusterRoleBindings name."""
    roles = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ClusterRole"}
    bound = [b["roleRef"]["name"] for b in objects if b["kind"] == "ClusterRoleBinding" and SA in b["subjects"]]
    return set().union(*(granted(roles[name]["rules"]) for name in bound))


class TestNoClusterWideWrites:
    def test_by_default_the_operator_may_not_touch_secrets_or_make_pods_in_any_namespace(self) -> None:
        have = cluster_wide_grants(render())
        assert not {v for _, r, v in have if r in ("secrets", "configmaps")}
        writes = {(r, v) for _, r, v in have if v not in ("get", "list", "watch")}
        assert {r for r, _ in writes} <= CLUSTER_WIDE_WRITES, writes - {(r, v) for r, v in writes if r in CLUSTER_WIDE_WRITES}
        assert ("rlexperiments", "watch") in {(r, v) for _, r, v in have}  # it still sees every experiment

    def test_each_tenant_namespace_gets_a_binding_to_the_namespaced_cluster_role(self) -> None:
        objects = render({"tenantNamespaces": ["team-a", "team-b"]})
        bindings = [o for o in objects if o["kind"] == "RoleBinding" and not o["metadata"]["name"].endswith("-leader-election")]
        assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
        for b in bindings:
            assert b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "kuberl-namespaced"}
            assert b["subjects"] == [SA]
        assert not {v for _, r, v in cluster_wide_grants(objects) if r == "secrets"}

    def test_cluster_wide_writes_are_an_explicit_opt_in(self) -> None:
        have = cluster_wide_grants(render({"rbac": {"clusterWideWrites": True}}))
        assert {v for _, r, v in have if r == "secrets"} == {"get", "create", "patch"}

    def test_the_operator_checks_exactly_what_the_namespaced_role_grants(self) -> None:
        """kuberl.operator.access.WRITES (asked before anything is applied) and the chart's kuberl.writeRules agree."""
        assert granted(one(render(), "ClusterRole", "kuberl-namespaced")["rules"]) == set(access.WRITES)

    def test_the_deployment_names_the_namespaced_role_for_the_fix_the_operator_prints(self) -> None:
        env = {e["name"]: e.get("value") for e in one(render(), "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env[access.CLUSTER_ROLE_ENV] == "kuberl-namespaced"

    def test_the_default_opens_the_default_namespace_only_and_watched_namespaces_use_their_roles(self) -> None:
        def writes(objects: list[dict]) -> list[tuple[str, str, str]]:  # RoleBindings but the leader election's own Lease
            return [(b["metadata"]["namespace"], b["roleRef"]["kind"], b["roleRef"]["name"]) for b in objects
                    if b["kind"] == "RoleBinding" and not b["metadata"]["name"].endswith("-leader-election")]

        assert writes(render()) == [("default", "ClusterRole", "kuberl-namespaced")]
        watched = render({"watchNamespaces": ["a"], "tenantNamespaces": ["b"]})
        assert [(ns, kind) for ns, kind, _ in writes(watched)] == [("a", "Role")]
        assert not [o for o in watched if o["metadata"]["name"] == "kuberl-namespaced"]


class TestAggregatedTenantRoles:
    def labels(self, name: str) -> set[str]:
        labels = one(render(), "ClusterRole", name)["metadata"]["labels"]
        return {k.rpartition("/")[2] for k, v in labels.items() if k.startswith("rbac.authorization.k8s.io/") and v == "true"}

    def test_view_reaches_view_edit_and_admin_and_edit_reaches_edit_and_admin(self) -> None:
        assert self.labels("kuberl-rlexperiment-view") == {"aggregate-to-view", "aggregate-to-edit", "aggregate-to-admin"}
        assert self.labels("kuberl-rlexperiment-edit") == {"aggregate-to-edit", "aggregate-to-admin"}

    def test_view_only_reads_and_edit_writes_the_spec_not_the_status(self) -> None:
        view = granted(one(render(), "ClusterRole", "kuberl-rlexperiment-view")["rules"])
        edit = granted(one(render(), "ClusterRole", "kuberl-rlexperiment-edit")["rules"])
        assert {v for _, _, v in view} == {"get", "list", "watch"}
        assert ("kuberl.io", "rlexperiments", "create") in edit and ("kuberl.io", "rlexperiments/scale", "patch") in edit
        assert not {r for _, r, _ in edit} & {"rlexperiments/status"}

    def test_they_can_be_left_out(self) -> None:
        names = {o["metadata"]["name"] for o in render({"rbac": {"aggregateToDefaultRoles": False}}) if o["kind"] == "ClusterRole"}
        assert names == {"kuberl", "kuberl-namespaced"}


class TestAdmissionPolicy:
    def policy(self, values: dict | None = None) -> dict:
        return one(render(values), "ValidatingAdmissionPolicy")

    def test_the_values_become_the_policy_variables(self) -> None:
        policy = self.policy({"admissionPolicy": {"allowedServiceAccounts": ["trainer-wi"], "allowedImagePrefixes": ["registry.corp/"]}})
        variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
        assert variables.pop("fabric").startswith("namespaceObject != null")
        assert variables == {"serviceAccounts": '["trainer-wi"]', "imagePrefixes": '["registry.corp/"]', "capabilities": "[]",
                             "volumeTypes": '["configMap","csi","downwardAPI","emptyDir","ephemeral","persistentVolumeClaim","projected","secret"]'}

    def test_the_default_refuses_host_path_and_named_service_accounts_and_allows_any_image(self) -> None:
        variables = {v["name"]: v["expression"] for v in self.policy()["spec"]["variables"]}
        assert "hostPath" not in variables["volumeTypes"] and variables["serviceAccounts"] == "[]" and variables["imagePrefixes"] == '["*"]'

    def test_every_field_a_tenant_sets_is_checked_and_each_message_names_its_field(self) -> None:
        checks = self.policy()["spec"]["validations"]
        for field in ("rollout.podTemplate.serviceAccountName", "trainer.podTemplate.serviceAccountName", "rollout.podTemplate.volumes",
                      "trainer.podTemplate.volumes", "rollout.image", "trainer.image", "bus.embedded.image"):
            assert any(f"'spec.{field}: " in c["messageExpression"] and f"object.spec.{field}" in c["expression"] for c in checks), field

    def test_fabric_fields_are_checked_per_role_and_opened_by_the_value_or_the_namespace_label(self) -> None:
        checks = self.policy({"admissionPolicy": {"allowedCapabilities": ["IPC_LOCK"]}})["spec"]
        assert {v["name"]: v["expression"] for v in checks["variables"]}["capabilities"] == '["IPC_LOCK"]'
        for role in ("rollout", "trainer"):
            t = f"object.spec.{role}.podTemplate"
            caps = [c for c in checks["validations"] if f"{t}.capabilities.all(" in c["expression"]]
            assert len(caps) == 1 and f"{t}.sidecars.all(s, !has(s.capabilities)" in caps[0]["expression"]
            assert "variables.fabric" in caps[0]["expression"] and "kuberl.io/fabric=allowed" in caps[0]["messageExpression"]
            root = [c for c in checks["validations"] if "s.runAsUser != 0" in c["expression"] and t in c["expression"]]
            assert len(root) == 1 and "variables.fabric" in root[0]["expression"]
            images = [c for c in checks["validations"] if f"{t}.sidecars.all(s, variables.imagePrefixes" in c["expression"]]
            assert len(images) == 1 and "admissionPolicy.allowedImagePrefixes" in images[0]["messageExpression"]
            volumes = [c for c in checks["validations"] if f"{t}.volumes.all(" in c["expression"]]
            assert len(volumes) == 1 and "(variables.fabric && k == 'hostPath')" in volumes[0]["expression"]

    def test_the_operator_itself_is_exempt_and_the_binding_takes_the_actions(self) -> None:
        objects = render({"admissionPolicy": {"validationActions": ["Warn", "Audit"]}})
        [condition] = one(objects, "ValidatingAdmissionPolicy")["spec"]["matchConditions"]
        assert condition["expression"] == f"request.userInfo.username != 'system:serviceaccount:{NAMESPACE}:kuberl'"
        binding = one(objects, "ValidatingAdmissionPolicyBinding")
        assert binding["spec"] == {"policyName": "kuberl-rlexperiment-restrictions", "validationActions": ["Warn", "Audit"]}

    def test_disabled_renders_nothing(self) -> None:
        assert not [o for o in render({"admissionPolicy": {"enabled": False}}) if "AdmissionPolicy" in o["kind"]]

    @pytest.mark.parametrize("values,field", [
        ({"allowedVolumeTypes": ["hostpath"]}, "allowedVolumeTypes"),
        ({"allowedServiceAccounts": ["Not A Name"]}, "allowedServiceAccounts"),
        ({"allowedImagePrefixes": ["it's"]}, "allowedImagePrefixes"),
        ({"validationActions": ["Block"]}, "validationActions"),
        ({"allowedCapabilities": ["SYS_ADMIN"]}, "allowedCapabilities"),
    ])
    def test_the_schema_refuses_what_the_policy_could_not_use(self, values: dict, field: str) -> None:
        with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError) as err:
            chart.validate_schema(chart.merge_values({"admissionPolicy": values}))
        assert field in str(err.value)


class TestAccessCheck:
    def test_a_rule_limited_to_names_or_another_verb_does_not_cover_a_write(self) -> None:
        rules = [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create", "patch"], "resourceNames": ["one"]},
                 {"apiGroups": ["apps"], "resources": ["statefulsets"], "verbs": ["get"]}]
        assert not access.covered(rules, "", "secrets", "create")
        assert not access.covered(rules, "apps", "statefulsets", "patch")
        assert access.covered([{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}], "batch", "jobs", "delete")
        assert access.covered([{"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["delete"]}], "batch", "jobs", "delete")

    def test_the_message_names_the_namespace_what_is_refused_and_the_command(self) -> None:
        message = access.not_permitted_message("team-c", [("", "secrets", "create"), ("apps", "statefulsets", "patch")],
                                               "system:serviceaccount:kuberl-system:kuberl")
        assert "namespace 'team-c'" in message and "secrets, statefulsets.apps refused" in message
        assert ("`kubectl create rolebinding kuberl-operator -n team-c --clusterrole=kuberl-namespaced "
                "--serviceaccount=kuberl-system:kuberl`") in message
        assert "tenantNamespaces" in message

    def test_one_review_answers_a_burst_of_reconciles_and_a_retry_asks_again(self, monkeypatch) -> None:
        import asyncio

        asked: list[str] = []

        async def review(namespace: str) -> tuple:
            asked.append(namespace)
            return (("", "secrets", "create"),)

        clock = [1000.0]
        monkeypatch.setattr(access, "_review", review)
        monkeypatch.setattr(access, "_checked", {})
        monkeypatch.setattr(access.time, "monotonic", lambda: clock[0])
        for _ in range(50):  # the operator starting: every experiment of the namespace reconciles
            assert asyncio.run(access.denied_writes("team-c")) == (("", "secrets", "create"),)
        assert asked == ["team-c"]
        clock[0] += 15  # kopf's retry of the blocked reconcile (CONFIG.retry_delay)
        asyncio.run(access.denied_writes("team-c"))
        asyncio.run(access.denied_writes("team-c", recheck=False))  # a monitor tick: the answer just asked
        assert asked == ["team-c", "team-c"]

    def test_ticks_that_find_the_answer_expired_at_once_send_one_review(self, monkeypatch) -> None:
        """500 experiments' monitor ticks found the answer expired together and sent 150 reviews in 90 s: the ticks
        of one namespace now wait for the one review in flight."""
        import asyncio

        asked: list[str] = []

        async def review(namespace: str) -> tuple:
            asked.append(namespace)
            await asyncio.sleep(0.05)  # the API server's answer takes a while under load
            return ()

        monkeypatch.setattr(access, "_review", review)
        monkeypatch.setattr(access, "_checked", {})

        async def ticks() -> list:
            return await asyncio.gather(*(access.denied_writes(ns, recheck=False) for ns in ["team-c"] * 100 + ["team-d"] * 20))

        assert asyncio.run(ticks()) == [()] * 120
        assert sorted(asked) == ["team-c", "team-d"]

