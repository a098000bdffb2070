"""The Helm chart charts/kuberl, linted and rendered offline with helm-python-sdk (Helm's Go SDK):
every rendered object passes kubernetes-validate strict mode, the operator's arguments parse as
`kuberl operator`, RBAC is least-privilege and covers the Roles the operator grants, the chart's
CRD equals crds/, and values.schema.json rejects bad values with a message naming the field."""

from __future__ import annotations

from pathlib import Path

import helm_python as helm  # kuberl[test]: a missing install fails, it is not skipped
import jsonschema
import kubernetes_validate
import pytest
import yaml

from kuberl.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kuberl"
CRD_FILE = "kuberl.io_rlexperiments.yaml"
KUBE_VERSION = "1.32"
# Custom kinds the chart may render; kubernetes-validate knows built-in kinds only.
CUSTOM_KINDS = {"ServiceMonitor", "PodMonitor", "KopfPeering", "ClusterKopfPeering"}
NAMESPACE = "kuberl-system"


def render(values: dict | None = None) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values or {}, name="kuberl", namespace=NAMESPACE, is_install=True)
    objects = []
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        objects += [d for d in yaml.safe_load_all(text) if d]
    return objects


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


OPERATOR_ROLES = ("kuberl", "kuberl-namespaced")  # the operator's ClusterRoles (the rest are tenant roles)


def operator_rules(objects: list[dict]) -> list[dict]:
    """Every rule the operator's own ClusterRoles hold: what it may do once bound in a namespace."""
    return [r for o in objects if o["kind"] == "ClusterRole" and o["metadata"]["name"] in OPERATOR_ROLES for r in o["rules"]]


def chart_crds() -> dict[str, dict]:
    """Each CRD shipped in the chart's crds/, by name."""
    out = {}
    for path in sorted((CHART / "crds").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out[doc["metadata"]["name"]] = doc
    return out


PEERING = {"peering": {"enabled": True}, "leaderElection": {"enabled": False}}  # kopf peering instead of the Lease
VARIANTS = {
    "defaults": {},
    "kopf peering": PEERING,
    "namespaced with servicemonitor": {"watchNamespaces": ["team-a", "team-b"], "metrics": {"serviceMonitor": {"enabled": True}}},
    "experiment podmonitor and dashboard": {"podMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
                                            "grafanaDashboard": {"enabled": True, "namespace": "monitoring"}},
    "standalone without metrics": {"peering": {"enabled": False}, "metrics": {"enabled": False}, "replicaCount": 1},
    "existing service account": {"serviceAccount": {"create": False, "name": "ops"}, "rbac": {"create": False}},
    "tenant namespaces and a restricted admission policy": {
        "tenantNamespaces": ["team-a", "team-b"],
        "admissionPolicy": {"allowedServiceAccounts": ["trainer-wi"], "allowedImagePrefixes": ["europe-docker.pkg.dev/p/"],
                            "validationActions": ["Warn", "Audit"]}},
    "cluster-wide writes, no tenant roles, no admission policy": {"rbac": {"clusterWideWrites": True, "aggregateToDefaultRoles": False},
                                                                  "admissionPolicy": {"enabled": False}},
    "private registry": {
        "image": {"repository": "europe-docker.pkg.dev/my-project/kuberl/operator"},
        "runtimeImages": {"repository": "europe-docker.pkg.dev/my-project/kuberl"},
    },
}


def test_chart_lints_clean_in_strict_mode():
    report = helm.lint(str(CHART), strict=True, kube_version=f"v{KUBE_VERSION}.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


@pytest.mark.parametrize("values", VARIANTS.values(), ids=VARIANTS.keys())
def test_every_rendered_object_passes_strict_kubernetes_validation(values):
    objects = render(values)
    assert objects
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("values", VARIANTS.values(), ids=VARIANTS.keys())
def test_rendered_peering_objects_match_the_peering_crds(values):
    crds = chart_crds()
    for obj in render(values):
        if obj["kind"] not in {"KopfPeering", "ClusterKopfPeering"}:
            continue
        crd = next(c for c in crds.values() if c["spec"]["names"]["kind"] == obj["kind"])
        assert obj["apiVersion"] == f"{crd['spec']['group']}/{crd['spec']['versions'][0]['name']}"
        assert ("namespace" in obj["metadata"]) == (crd["spec"]["scope"] == "Namespaced")
        jsonschema.validate(obj, crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def test_chart_crds_pass_strict_kubernetes_validation():
    crds = chart_crds()
    assert "rlexperiments.kuberl.io" in crds
    for crd in crds.values():
        kubernetes_validate.validate(crd, KUBE_VERSION, strict=True)


def test_chart_crd_equals_the_generated_crd_in_crds():
    generated = ROOT / "crds" / CRD_FILE
    shipped = CHART / "crds" / CRD_FILE
    assert generated.exists(), f"{generated} is missing: generate it with `kuberl crd -o crds/`"
    assert shipped.read_text() == generated.read_text(), (
        f"{shipped.relative_to(ROOT)} differs from crds/{CRD_FILE}: sync it with "
        f"`cp crds/{CRD_FILE} charts/kuberl/crds/` (docs/operations.md)"
    )


class TestOperatorDeployment:
    def container(self, values=None) -> dict:
        return one(render(values), "Deployment")["spec"]["template"]["spec"]["containers"][0]

    def test_image_defaults_to_the_operator_image_at_the_chart_app_version(self):
        app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
        assert self.container()["image"] == f"ghcr.io/kuberl/operator:{app_version}"
        assert self.container({"image": {"tag": "dev"}})["image"] == "ghcr.io/kuberl/operator:dev"

    def test_runtime_image_repository_reaches_the_operator_as_the_env_it_reads(self):
        from kuberl.operator import main  # kuberl[operator]: a missing install fails, it is not skipped
        from kuberl.operator.builders import common

        def env(values=None) -> dict:
            return {e["name"]: e.get("value") for e in self.container(values)["env"]}

        assert env()[main.RUNTIME_IMAGE_REPOSITORY_ENV] == common.DEFAULT_IMAGE_REPOSITORY == "ghcr.io/kuberl"
        ecr = "123456789012.dkr.ecr.us-east-1.amazonaws.com/kuberl"
        rendered = env({"runtimeImages": {"repository": ecr}})
        assert rendered[main.RUNTIME_IMAGE_REPOSITORY_ENV] == ecr
        # What the operator makes of the rendered env: its default runtime images come from there.
        try:
            assert main.configure_runtime_images(rendered) == ecr
            assert common.default_image("vllm", "nvidia").startswith(f"{ecr}/runtime-vllm:")
        finally:
            common.configure_images(None)

    def test_args_parse_as_kuberl_operator_with_the_ports_and_namespaces_of_the_values(self):
        c = self.container({"watchNamespaces": ["ns1"], "metrics": {"port": 9090}, "health": {"port": 9091}})
        args = build_parser().parse_args(c["args"])
        assert (args.command, args.metrics_port, args.health_port, args.namespace, args.standalone) == (
            "operator", 9090, 9091, ["ns1"], False
        )
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"metrics": 9090, "health": 9091}

    def test_liveness_and_readiness_probe_the_health_port(self):
        c = self.container({"health": {"port": 7000, "path": "/live"}})
        for probe in ("livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"] == {"path": "/live", "port": "health"}
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["health"] == 7000

    def test_disabled_metrics_turn_the_port_off_and_drop_the_service(self):
        objects = render({"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}})
        c = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
        assert build_parser().parse_args(c["args"]).metrics_port == 0
        assert not [o for o in objects if o["kind"] in {"Service", "ServiceMonitor"}]

    def test_the_default_elects_a_leader_by_lease_without_peering_objects(self):
        objects = render()
        args = build_parser().parse_args(one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"])
        assert args.leader_election is True and args.standalone is False
        assert not [o for o in objects if "Peering" in o["kind"]]
        assert [o["metadata"]["name"] for o in objects if o["kind"] == "Role"] == ["kuberl-leader-election"]

    def test_peering_disabled_runs_standalone_without_peering_objects(self):
        objects = render({"peering": {"enabled": False}, "leaderElection": {"enabled": False}})
        c = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
        assert build_parser().parse_args(c["args"]).standalone is True
        assert not [o for o in objects if "Peering" in o["kind"]]

    def test_peering_is_cluster_wide_or_one_per_watched_namespace(self):
        assert [o["kind"] for o in render(PEERING) if "Peering" in o["kind"]] == ["ClusterKopfPeering"]
        per_ns = [o for o in render({**PEERING, "watchNamespaces": ["x", "y"]}) if "Peering" in o["kind"]]
        assert [(o["kind"], o["metadata"]["namespace"]) for o in per_ns] == [("KopfPeering", "x"), ("KopfPeering", "y")]

    def test_peering_objects_carry_the_name_the_operator_peers_under(self):
        from kuberl.operator.main import PEERING_NAME
        for values in (PEERING, {**PEERING, "watchNamespaces": ["x"]}):
            names = {o["metadata"]["name"] for o in render(values) if "Peering" in o["kind"]}
            assert names == {PEERING_NAME}

    def test_probe_path_is_the_one_the_operator_serves(self):
        """kuberl operator serves kopf's liveness endpoint at /healthz on --health-port."""
        main_py = (ROOT / "operator" / "kuberl" / "operator" / "main.py").read_text()
        path = self.container()["livenessProbe"]["httpGet"]["path"]
        assert f"{{args.health_port}}{path}" in main_py

    def test_runs_non_root_with_a_read_only_root_file_system_and_no_capabilities(self):
        pod = one(render(), "Deployment")["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp"}
        assert c["resources"]["requests"] and c["resources"]["limits"]

    def test_metrics_service_selects_the_operator_pods_on_the_metrics_port(self):
        objects = render()
        svc = one(objects, "Service")
        pod_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= pod_labels.items()
        assert svc["spec"]["ports"][0]["targetPort"] == "metrics"

    def test_service_monitor_scrapes_the_metrics_port_of_the_service(self):
        objects = render({"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}})
        sm, svc = one(objects, "ServiceMonitor"), one(objects, "Service")
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
        assert sm["metadata"]["labels"]["release"] == "prom"


def granted(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule.get("apiGroups", [""]) for r in rule["resources"] for v in rule["verbs"]}


class TestRBAC:
    def rules(self) -> list[dict]:
        return operator_rules(render())

    def test_binding_names_the_operator_service_account(self):
        objects = render()
        binding, sa = one(objects, "ClusterRoleBinding"), one(objects, "ServiceAccount")
        assert binding["roleRef"]["name"] == "kuberl"
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}]
        pod = one(objects, "Deployment")["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == sa["metadata"]["name"]

    def test_no_wildcards_and_no_privilege_escalation_verbs(self):
        for rule in self.rules():
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule.get(field, []), rule
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule

    @pytest.mark.parametrize(
        "group,resource,verbs",
        [
            ("kuberl.io", "rlexperiments", {"get", "list", "watch", "patch", "delete"}),
            ("kuberl.io", "rlexperiments/status", {"patch"}),
            ("kuberl.io", "rlexperiments/scale", {"get", "patch"}),
            ("", "configmaps", {"get", "create", "patch"}),
            ("", "secrets", {"get", "create", "patch"}),
            ("", "services", {"get", "create", "patch"}),
            ("", "serviceaccounts", {"get", "create", "patch"}),
            ("", "persistentvolumeclaims", {"get", "create", "patch"}),
            ("apps", "statefulsets", {"get", "create", "patch", "watch"}),
            ("batch", "jobs", {"get", "create", "patch", "delete", "watch"}),
            ("networking.k8s.io", "networkpolicies", {"get", "create", "patch"}),
            ("policy", "poddisruptionbudgets", {"get", "create", "patch"}),
            ("", "events", {"create", "patch"}),
            ("", "pods", {"get", "list", "watch"}),
            ("", "nodes", {"get", "list"}),
            ("", "namespaces", {"list", "watch"}),
            ("apiextensions.k8s.io", "customresourcedefinitions", {"get", "list", "watch"}),
        ],
    )
    def test_grants_what_the_operator_needs(self, group, resource, verbs):
        have = granted(self.rules())
        missing = {v for v in verbs if (group, resource, v) not in have}
        assert not missing, f"{group or 'core'}/{resource}: missing verbs {sorted(missing)}"

    def test_grants_every_kind_the_operator_client_reads_or_writes(self):
        """operator/kuberl/operator/kube.py lists each kind the operator touches; the ClusterRole must cover each one."""
        from kuberl.operator import kube
        have = {(g, r) for g, r, _ in granted(self.rules())}
        for kind, (api_version, plural, _) in kube.KINDS.items():
            if kind == "Lease":  # the leader-election Role's, in the release namespace (test_chart_rbac)
                continue
            group = api_version.rpartition("/")[0]
            assert (group, plural) in have, f"operator/kuberl/operator/kube.py uses {kind} ({group or 'core'}/{plural}); the ClusterRole has no rule"

    def test_pods_and_nodes_are_read_only(self):
        for _group, resource, verb in granted(self.rules()):
            if resource in {"pods", "nodes", "namespaces", "customresourcedefinitions"}:
                assert verb in {"get", "list", "watch"}, (resource, verb)

    def test_the_operator_grants_nothing_so_it_holds_no_rbac_rights(self):
        """The experiments' pods get a token-less ServiceAccount and no Role; so the operator needs no
        rights over Roles or RoleBindings (which would let it bind up to its own permissions)."""
        from kuberl.api import load_experiment
        from kuberl.operator import builders

        assert not {g for g, _, _ in granted(self.rules())} & {"rbac.authorization.k8s.io"}
        for example in sorted((ROOT / "examples").glob("*.yaml")):
            kinds = {o["kind"] for o in builders.build_children(load_experiment(example), bus_token="t")}
            assert not kinds & {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}, example.name


BAD_VALUES = {
    "replica count as text": ({"replicaCount": "two"}, "replicaCount"),
    "unknown pull policy": ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
    "misspelt top-level key": ({"replicas": 2}, "replicas"),
    "namespace that is no DNS label": ({"watchNamespaces": ["Team_A"]}, "watchNamespaces"),
    "metrics port out of range": ({"metrics": {"port": 70000}}, "port"),
    "scrape interval in words": ({"metrics": {"serviceMonitor": {"interval": "30 seconds"}}}, "interval"),
    "root allowed": ({"podSecurityContext": {"runAsNonRoot": False}}, "runAsNonRoot"),
    "cpu that is no quantity": ({"resources": {"requests": {"cpu": "lots"}}}, "cpu"),
    "health path without slash": ({"health": {"path": "healthz"}}, "path"),
    "runtime image repository with a tag": ({"runtimeImages": {"repository": "ghcr.io/kuberl:0.1.0"}}, "repository"),
    "runtime image repository in capitals": ({"runtimeImages": {"repository": "ghcr.io/KubeRL"}}, "repository"),
    "runtime image repository empty": ({"runtimeImages": {"repository": ""}}, "repository"),
}


@pytest.mark.parametrize("values,field", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_values_schema_rejects_bad_values_naming_the_field(values, field):
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError) as err:
        chart.validate_schema(chart.merge_values(values))
    assert field in str(err.value), str(err.value)


def test_values_schema_accepts_the_defaults_and_every_variant():
    with helm.Chart.load(CHART) as chart:
        for values in VARIANTS.values():
            chart.validate_schema(chart.merge_values(values))


REPOSITORIES = [
    "ghcr.io/kuberl", "kuberl", "localhost:5000/kuberl", "europe-docker.pkg.dev/my-project/kuberl",
    "123456789012.dkr.ecr.us-east-1.amazonaws.com/team/kuberl", "registry.example.com/a__b/c-d.e",
    "ghcr.io/kuberl:0.1.0", "ghcr.io/KubeRL", "ghcr.io/kuberl@sha256:00", "https://ghcr.io/kuberl", "ghcr.io//kuberl", "",
]


@pytest.mark.parametrize("repository", REPOSITORIES)
def test_the_chart_accepts_the_runtime_image_repositories_the_operator_accepts(repository):
    """values.schema.json and the operator (KUBERL_RUNTIME_IMAGE_REPOSITORY) agree on what is a repository."""
    from kuberl.operator.builders import common
    try:
        common.image_repository(repository)
        operator_ok = True
    except ValueError:
        operator_ok = False
    with helm.Chart.load(CHART) as chart:
        try:
            chart.validate_schema(chart.merge_values({"runtimeImages": {"repository": repository}}))
            chart_ok = True
        except helm.HelmError:
            chart_ok = False
    assert chart_ok == operator_ok, f"{repository!r}: chart {'accepts' if chart_ok else 'rejects'} it, the operator does not"
