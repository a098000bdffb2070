"""Prometheus metrics of the trainer and the rollout agents (runtime/kuberl/runtime/prom.py), the chart's
PodMonitor and Grafana dashboard, and the ports and NetworkPolicy rules that let Prometheus scrape them.

The trainer's endpoint is the real HTTP server `Tracking.from_spec` starts on $KUBERL_METRICS_PORT; the
agent's is the real probe server (rollout/health.py) reading a real RolloutAgent. Both are scraped over
loopback and parsed with prometheus_client's own parser. The dashboard test checks every metric and
label each panel queries against what those two endpoints expose.
"""

from __future__ import annotations

import json
import math
import re
import urllib.request
from pathlib import Path

import aiohttp
import helm_python as helm
import promql_parser  # kuberl[test]: parses the dashboard's queries as Prometheus would
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kuberl.api import RLExperiment
from kuberl.operator import naming
from kuberl.operator.builders import network
from kuberl.operator.builders.rollout import build_rollout_statefulset
from kuberl.operator.builders.trainer import METRICS_PORT, METRICS_PORT_ENV, build_trainer_job
from kuberl.runtime.rollout.agent import RolloutAgent
from kuberl.runtime.rollout.health import AgentHealth, start_health_server
from kuberl.runtime.tracking import Tracking

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kuberl"
DASHBOARD = CHART / "dashboards" / "kuberl-training.json"

# A step's metrics.jsonl row as the trainer writes it (trainer.py stage_report).
ROW = {"step": 7, "time": 1795487877.25, "policy_version": 7, "samples_per_second": 12.5, "dropped_stale": 3, "failed_groups": 1,
       "approx_kl": 0.01, "clip_fraction": 0.05, "entropy": 5.7, "loss": -0.25, "grad_norm": 0.04, "lr": 0.001, "tokens": 512.0,
       "samples": 64, "wait_seconds": 0.5, "step_seconds": 2.0, "reward_mean": 0.375, "group_ids": ["a"], "staleness_mean": 0.5, "staleness_max": 2,
       "timings": {"train.collect": 0.5, "train.ppo_update": 1.2, "train.publish_weights": 0.125}}
EVAL_ROW = {"eval/reward_mean": 0.625, "eval/pass_at_4": 0.75, "evaluated_step": 7}


def scrape_text(text: str) -> dict[str, list]:
    """Sample name -> [(labels, value)] of a Prometheus text exposition."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples: dict[str, list], name: str, **labels: str) -> float:
    found = [v for lab, v in samples[name] if all(lab.get(k) == want for k, want in labels.items())]
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]


# -- trainer ---------------------------------------------------------------------------------------


@pytest.fixture
def trainer_scrape(tmp_path, monkeypatch):
    """Tracking with no spec.tracking but $KUBERL_METRICS_PORT set (0: a free port): log ROW, scrape."""
    monkeypatch.setenv(METRICS_PORT_ENV, "0")
    tracking = Tracking.from_spec(None, workdir=tmp_path, name="exp", namespace="ns")
    try:
        assert tracking.prometheus_server is not None, "no /metrics server without spec.tracking"
        port = tracking.prometheus_server.server_port
        tracking.log(ROW["step"], ROW)
        tracking.log(ROW["step"], EVAL_ROW)  # a late evaluation round: its own line, same step
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        yield scrape_text(text)
    finally:
        tracking.close(timeout=5)


def test_trainer_metrics_after_a_logged_step(trainer_scrape):
    s = trainer_scrape
    assert value(s, "kuberl_trainer_step") == 7
    assert value(s, "kuberl_trainer_policy_version") == 7
    assert value(s, "kuberl_trainer_reward_mean") == 0.375
    assert value(s, "kuberl_trainer_samples_per_second") == 12.5
    assert value(s, "kuberl_trainer_tokens_per_second") == 512.0 / 2.0
    assert value(s, "kuberl_trainer_staleness_mean") == 0.5
    assert value(s, "kuberl_trainer_staleness_max") == 2
    assert value(s, "kuberl_trainer_dropped_stale_groups") == 3
    assert value(s, "kuberl_trainer_failed_groups") == 1
    assert value(s, "kuberl_trainer_weight_sync_seconds") == 0.125
    assert value(s, "kuberl_trainer_stage_seconds", stage="train.ppo_update") == 1.2
    assert value(s, "kuberl_trainer_wait_fraction") == 0.25
    assert value(s, "kuberl_trainer_entropy") == 5.7
    assert value(s, "kuberl_trainer_learning_rate") == 0.001
    assert value(s, "kuberl_trainer_last_step_timestamp_seconds") == ROW["time"]
    # Counters count training steps only: the evaluation line adds nothing.
    assert value(s, "kuberl_trainer_steps_total") == 1
    assert value(s, "kuberl_trainer_samples_total") == 64
    assert value(s, "kuberl_trainer_tokens_total") == 512
    assert value(s, "kuberl_trainer_eval", metric="reward_mean") == 0.625
    assert value(s, "kuberl_trainer_eval", metric="pass_at_4") == 0.75
    assert value(s, "kuberl_trainer_reward_mean") == 0.375  # the evaluation line leaves the step's gauges alone


def test_no_metrics_server_without_the_port(tmp_path, monkeypatch):
    monkeypatch.delenv(METRICS_PORT_ENV, raising=False)
    tracking = Tracking.from_spec(None, workdir=tmp_path, name="exp", namespace="ns")
    assert tracking.prometheus is None and tracking.prometheus_server is None
    tracking.log(1, ROW)  # nothing to set, nothing fails
    tracking.close(timeout=5)


@pytest.mark.parametrize("bad", ["metrics", "70000", "-1"])
def test_a_bad_metrics_port_is_refused_naming_the_variable(tmp_path, monkeypatch, bad):
    monkeypatch.setenv(METRICS_PORT_ENV, bad)
    with pytest.raises(ValueError, match=METRICS_PORT_ENV):
        Tracking.from_spec(None, workdir=tmp_path, name="exp", namespace="ns")


# -- agent -----------------------------------------------------------------------------------------


class Engine:
    url = "http://engine"

    def __init__(self) -> None:
        self.version = 5
        self._in_flight = 3

    async def health(self) -> bool:
        return True


def experiment() -> RLExperiment:
    return RLExperiment.model_validate({"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "t"}, "spec": {
        "model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}, "training": {"totalSteps": 3},
        "algorithm": {"samplesPerPrompt": 2}, "rollout": {"concurrency": 4}}})


async def scrape_agent(state: AgentHealth) -> dict[str, list]:
    runner = await start_health_server(state, 0, host="127.0.0.1")
    try:
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=")  # the text format Prometheus scrapes
            return scrape_text(await resp.text())
    finally:
        await runner.cleanup()


@pytest.fixture
async def agent_scrape(tmp_path):
    agent = RolloutAgent(experiment(), None, Engine(), None, [], workdir=tmp_path, agent_id="a0")
    agent.stats.published, agent.stats.rejected, agent.stats.failed, agent.stats.samples = 6, 2, 1, 12
    agent.stats.reward_sum, agent.stats.weight_updates, agent.stats.evaluated = 3.0, 4, 9
    agent._episodes.update({object(), object()})  # two episodes running
    state = AgentHealth()
    state.agent = agent
    return await scrape_agent(state)


async def test_agent_metrics_read_the_agent_at_scrape_time(agent_scrape):
    s = agent_scrape
    assert value(s, "kuberl_agent_groups_published_total") == 6
    assert value(s, "kuberl_agent_groups_rejected_total") == 2
    assert value(s, "kuberl_agent_episodes_failed_total") == 1
    assert value(s, "kuberl_agent_samples_total") == 12
    assert value(s, "kuberl_agent_weight_updates_total") == 4
    assert value(s, "kuberl_agent_eval_tickets_total") == 9
    assert value(s, "kuberl_agent_reward_mean") == 0.25
    assert value(s, "kuberl_agent_episodes_in_flight") == 2
    assert value(s, "kuberl_agent_concurrency") == 4
    assert value(s, "kuberl_agent_engine_generations_in_flight") == 3
    assert value(s, "kuberl_agent_engine_down") == 0
    assert value(s, "kuberl_agent_policy_version") == 5
    assert 0 <= value(s, "kuberl_agent_seconds_since_progress") < 60


async def test_agent_metrics_are_empty_while_the_agent_starts():
    s = await scrape_agent(AgentHealth())
    assert not [n for n in s if n.startswith("kuberl_agent_")]


async def test_agent_reward_mean_is_nan_before_any_sample(tmp_path):
    state = AgentHealth()
    state.agent = RolloutAgent(experiment(), None, Engine(), None, [], workdir=tmp_path, agent_id="a0")
    assert math.isnan(value(await scrape_agent(state), "kuberl_agent_reward_mean"))


# -- the dashboard against what the code exposes --------------------------------------------------

# Labels Prometheus adds to every target (pod discovery) and the PodMonitor's relabelings add.
TARGET_LABELS = {"namespace", "pod", "container", "endpoint", "job", "instance", "experiment", "role"}
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$namespace": ".*", "$experiment": ".*"}
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>[a-zA-Z_][a-zA-Z0-9_]*)\)$")
LEGEND_LABEL = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")


def dashboard_queries() -> list[tuple[str, str, str | None, str]]:
    """(where, PromQL with Grafana's variables filled in, label its result must carry or None, legend)."""
    dash = json.loads(DASHBOARD.read_text())
    out = []

    def fill(expr: str) -> str:
        for var, val in GRAFANA_VARIABLES.items():
            expr = expr.replace(var, val)
        assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
        return expr

    for v in dash["templating"]["list"]:
        if isinstance(v.get("query"), dict):
            m = LABEL_VALUES.match(v["query"]["query"])
            assert m, f"variable {v['name']}: {v['query']['query']!r} is no label_values(selector, label)"
            out.append((f"variable {v['name']}", fill(m["selector"]), m["label"], ""))
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], fill(target["expr"]), None, target.get("legendFormat", "")))
    return out


def query_labels(node, exposed: dict[str, list], where: str, used: set[str]) -> set[str]:
    """Check every selector of a parsed query against `exposed`; the labels its result carries."""
    if isinstance(node, promql_parser.VectorSelector):
        assert node.name in exposed, f"{where}: {node.name} is not exposed by the trainer or the agents"
        used.add(node.name)
        labels = set().union(*(lab for lab, _ in exposed[node.name])) | TARGET_LABELS
        for m in node.matchers.matchers:
            assert m.name in labels, f"{where}: {node.name} has no label {m.name!r}"
        return labels
    if isinstance(node, promql_parser.MatrixSelector):
        return query_labels(node.vector_selector, exposed, where, used)
    if isinstance(node, promql_parser.AggregateExpr):
        inner = query_labels(node.expr, exposed, where, used)
        if node.modifier is None:
            return set()
        grouping = set(node.modifier.labels)
        if node.modifier.type == promql_parser.AggModifierType.By:
            assert grouping <= inner, f"{where}: grouped by {sorted(grouping - inner)}, which the series lack"
            return grouping
        return inner - grouping
    if isinstance(node, promql_parser.Call):
        return set().union(*(query_labels(a, exposed, where, used) for a in node.args))
    if isinstance(node, promql_parser.BinaryExpr):
        return query_labels(node.lhs, exposed, where, used) | query_labels(node.rhs, exposed, where, used)
    if isinstance(node, promql_parser.ParenExpr):
        return query_labels(node.expr, exposed, where, used)
    assert isinstance(node, (promql_parser.NumberLiteral, promql_parser.StringLiteral)), f"{where}: unexpected {type(node).__name__}"
    return set()


def test_every_dashboard_query_parses_and_names_metrics_and_labels_the_code_exposes(trainer_scrape, agent_scrape):
    exposed = {**trainer_scrape, **agent_scrape}
    queries = dashboard_queries()
    assert len(queries) > 20
    used: set[str] = set()
    for where, expr, label, legend in queries:
        try:
            tree = promql_parser.parse(expr)
        except Exception as exc:
            raise AssertionError(f"{where}: {expr!r} is no PromQL: {exc}") from None
        names: set[str] = set()
        result = query_labels(tree, exposed, where, names)
        assert names, f"{where}: {expr!r} queries no kuberl metric"
        used |= names
        for name in ([label] if label else []) + LEGEND_LABEL.findall(legend):
            assert name in result, f"{where}: {expr!r} has no label {name!r} (legend or variable)"
    # Every family the code exports has a panel (a new metric needs one, or a reason to be left out).
    families = {re.sub(r"_total$", "", n) for n in exposed if n.startswith("kuberl_") and not n.endswith("_created")}
    panelled = {re.sub(r"_total$", "", n) for n in used}
    assert families - panelled == set()


# -- chart: PodMonitor, dashboard ConfigMap ----------------------------------------------------------


def render(values: dict) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(chart.merge_values(values))
        manifests = chart.render(values, name="kuberl", namespace="kuberl-system", is_install=True)
    return [d for path, text in manifests.items() if not path.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d]


def test_podmonitor_and_dashboard_are_off_by_default():
    kinds = {o["kind"] for o in render({})}
    assert "PodMonitor" not in kinds
    assert not [o for o in render({}) if o["kind"] == "ConfigMap" and "grafana_dashboard" in o["metadata"]["labels"]]


def test_podmonitor_scrapes_the_ports_the_operator_gives_the_pods():
    (pm,) = [o for o in render({"podMonitor": {"enabled": True}}) if o["kind"] == "PodMonitor"]
    exp = experiment()
    exp.metadata.namespace = "team-a"
    pods = {"trainer": build_trainer_job(exp)["spec"]["template"], "rollout": build_rollout_statefulset(exp)["spec"]["template"]}
    sel = pm["spec"]["selector"]
    (expr,) = sel["matchExpressions"]
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    for role, pod in pods.items():
        labels = pod["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in sel["matchLabels"].items()) and labels[expr["key"]] in expr["values"], role
    ports = {p["name"]: p["containerPort"] for pod in pods.values() for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    endpoints = pm["spec"]["podMetricsEndpoints"]
    assert {e["port"] for e in endpoints} == {"metrics", "probes"}
    assert ports["metrics"] == METRICS_PORT and ports["probes"] == naming.AGENT_HEALTH_PORT
    for e in endpoints:
        assert e["path"] == "/metrics"
        assert {r.get("targetLabel") for r in e["relabelings"]} >= {"experiment", "role"}
    # Only rank 0 serves: the trainer pods of nodes 1.. (Indexed Job label) are dropped, node 0 kept.
    (trainer_ep,) = [e for e in endpoints if e["port"] == "metrics"]
    (drop,) = [r for r in trainer_ep["relabelings"] if r.get("action") == "drop"]
    assert drop["sourceLabels"] == ["__meta_kubernetes_pod_label_batch_kubernetes_io_job_completion_index"]
    assert [i for i in ("0", "1", "2", "10") if re.fullmatch(drop["regex"], i)] == ["1", "2", "10"]


def test_podmonitor_namespaces_default_to_the_watched_ones():
    (pm,) = [o for o in render({"podMonitor": {"enabled": True}, "watchNamespaces": ["team-a"]}) if o["kind"] == "PodMonitor"]
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}
    (pm,) = [o for o in render({"podMonitor": {"enabled": True, "namespaces": ["x"]}, "watchNamespaces": ["team-a"]}) if o["kind"] == "PodMonitor"]
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["x"]}


def test_dashboard_configmap_carries_the_shipped_dashboard():
    (cm,) = [o for o in render({"grafanaDashboard": {"enabled": True, "namespace": "monitoring"}}) if o["kind"] == "ConfigMap"]
    assert cm["metadata"]["namespace"] == "monitoring" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kuberl-training.json"]) == json.loads(DASHBOARD.read_text())


# -- operator: the trainer's port and env, the NetworkPolicies' scrape rules -------------------------


def test_trainer_gets_the_metrics_port_and_its_env():
    (c,) = build_trainer_job(experiment())["spec"]["template"]["spec"]["containers"]
    assert {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"} in c["ports"]
    assert {"name": METRICS_PORT_ENV, "value": str(METRICS_PORT)} in c["env"]


def scrape_rules(policy: dict) -> list[dict]:
    return [r for r in policy["spec"]["ingress"] if any("namespaceSelector" in p and "podSelector" not in p for p in r["from"])]


def test_network_policies_admit_scrapers_on_the_metrics_ports_only(monkeypatch):
    monkeypatch.delenv(network.METRICS_NAMESPACES_ENV, raising=False)
    exp = experiment()
    for policy, port in [(network.build_trainer_network_policy(exp), METRICS_PORT),
                         (network.build_rollout_network_policy(exp), naming.AGENT_HEALTH_PORT)]:
        (rule,) = scrape_rules(policy)
        assert rule == {"from": [{"namespaceSelector": {}}], "ports": [{"protocol": "TCP", "port": port}]}
    monkeypatch.setenv(network.METRICS_NAMESPACES_ENV, "monitoring, prom")
    (rule,) = scrape_rules(network.build_trainer_network_policy(exp))
    assert rule["from"] == [{"namespaceSelector": {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring", "prom"]}]}}]


def test_bad_scrape_namespaces_are_refused(monkeypatch):
    monkeypatch.setenv(network.METRICS_NAMESPACES_ENV, "monitoring,Not_A_Namespace")
    with pytest.raises(ValueError, match="Not_A_Namespace"):
        network.build_trainer_network_policy(experiment())


# -- the trainer's own hook: stage_report ------------------------------------------------------------


async def test_the_trainer_serves_metrics_from_its_first_report_on_rank_0(tmp_path, monkeypatch):
    """The real Trainer.stage_report, without spec.tracking: /metrics answers before step 1, then shows the step."""
    import torch

    from kuberl.runtime.trainer.dist import DistInfo
    from kuberl.runtime.trainer.tickets import TicketBook
    from kuberl.runtime.trainer.trainer import Trainer
    from tests.unit.test_tracking import ReportBus, report, stats

    monkeypatch.setenv(METRICS_PORT_ENV, "0")
    t = Trainer(experiment(), bus_url="nats://unused:4222", workdir=tmp_path)
    t.info = DistInfo(0, 1, 0, torch.device("cpu"))
    t.book, t.bus, t.total_steps, t.step = TicketBook(20, 2, 0, total_groups=6), ReportBus(), 3, 0
    await t.stage_report(None)  # the report before step 1
    try:
        port = t.tracking.prometheus_server.server_port

        def scrape() -> dict[str, list]:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
                return scrape_text(resp.read().decode())

        assert "kuberl_trainer_step" in scrape()
        t.step = t.version = 1
        await report(t, {**stats(1), "tokens": 40.0, "timings": {"train.collect": 0.5, "train.publish_weights": 0.25}})
        s = scrape()
        assert value(s, "kuberl_trainer_step") == 1 and value(s, "kuberl_trainer_reward_mean") == 0.1
        assert value(s, "kuberl_trainer_samples_per_second") == 8.0 and value(s, "kuberl_trainer_tokens_per_second") == 40.0
        assert value(s, "kuberl_trainer_weight_sync_seconds") == 0.25
    finally:
        t.tracking.close(timeout=5)


async def test_other_ranks_serve_no_metrics(tmp_path, monkeypatch):
    import torch

    from kuberl.runtime.trainer.dist import DistInfo
    from kuberl.runtime.trainer.trainer import Trainer
    from tests.unit.test_tracking import report, stats

    monkeypatch.setenv(METRICS_PORT_ENV, "0")
    t = Trainer(experiment(), bus_url="nats://unused:4222", workdir=tmp_path)
    t.info = DistInfo(1, 2, 1, torch.device("cpu"))
    t.step = 1
    await report(t, stats(1))
    assert t.tracking is None
