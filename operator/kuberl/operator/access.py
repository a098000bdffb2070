"""Whether the operator may write an experiment's children in its namespace (issue #38.1, least privilege).

Cluster-wide, the chart lets the operator read everywhere but write (Secrets, ConfigMaps, the StatefulSets and Job
that make pods) only in namespaces where a RoleBinding grants it the ClusterRole "<release>-namespaced"
(charts/kuberl/templates/clusterrole.yaml). An experiment in any other namespace must say so, and how to fix it,
before the operator tries anything there: one SelfSubjectRulesReview per namespace (cached), checked against
WRITES, gives a NamespaceNotPermitted problem that keeps pods from being created (a condition, an event, a retry;
never a crash loop of 403s). An experiment is held back only by what it needs (`needed_by`): Deployments only with
workflow.sandbox.placement pod, so a namespace whose Role predates the sandbox still runs the others. Called by
kuberl.operator.observe.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator.builders.sandbox import sandbox_in_pods
from kuberl.operator.context import CONFIG, kube

# (apiGroup, resource, verb): what the operator does in an experiment's namespace beyond reading; the chart's
# kuberl.writeRules grant exactly these (tests/unit/test_chart_tenancy.py keeps them equal).
WRITES: tuple[tuple[str, str, str], ...] = (
    *((g, r, v) for g, r in (("", "configmaps"), ("", "secrets"), ("", "services"), ("", "serviceaccounts"),
                             ("", "persistentvolumeclaims"), ("networking.k8s.io", "networkpolicies"),
                             ("policy", "poddisruptionbudgets"), ("apps", "deployments")) for v in ("get", "create", "patch")),
    ("apps", "statefulsets", "create"), ("apps", "statefulsets", "patch"),
    ("batch", "jobs", "create"), ("batch", "jobs", "patch"), ("batch", "jobs", "delete"),
)
# What only an experiment with workflow.sandbox.placement pod writes (its sandbox's Deployment).
SANDBOX_WRITES = frozenset(("apps", "deployments", v) for v in ("get", "create", "patch"))
CLUSTER_ROLE_ENV = "KUBERL_NAMESPACED_CLUSTERROLE"  # set by the chart: "<release>-namespaced"
DEFAULT_CLUSTER_ROLE = "kuberl-namespaced"
RULES_REVIEW = "/apis/authorization.k8s.io/v1/selfsubjectrulesreviews"
ACCESS_REVIEW = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
SELF_REVIEW = "/apis/authentication.k8s.io/v1/selfsubjectreviews"

_checked: dict[str, tuple[float, tuple[tuple[str, str, str], ...]]] = {}  # namespace -> (when, denied)
_in_flight: dict[tuple[str, Any], asyncio.Future[tuple[tuple[str, str, str], ...]]] = {}  # (namespace, loop) -> review
_identity: list[str] = []  # the operator's user name, asked once


def _matches(values: Iterable[str], wanted: str) -> bool:
    values = list(values or [])
    return wanted in values or "*" in values


def covered(rules: Iterable[Mapping[str, Any]], group: str, resource: str, verb: str) -> bool:
    """Whether RBAC rules (as a SelfSubjectRulesReview lists them) allow `verb` on every object of `resource`:
    a rule limited to resourceNames cannot cover a create, so it does not count."""
    return any(not rule.get("resourceNames") and _matches(rule.get("apiGroups"), group)
               and _matches(rule.get("resources"), resource) and _matches(rule.get("verbs"), verb) for rule in rules)


async def _review(namespace: str) -> tuple[tuple[str, str, str], ...]:
    """The WRITES the operator may not do in `namespace`. The rules review lists what RBAC grants; where it is
    incomplete (another authorizer, e.g. GKE's IAM webhook), each write it does not cover is asked on its own."""
    body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectRulesReview", "spec": {"namespace": namespace}}
    status = (await kube().request("POST", RULES_REVIEW, body=body) or {}).get("status") or {}
    rules = status.get("resourceRules") or []
    missing = [w for w in WRITES if not covered(rules, *w)]
    if not status.get("incomplete"):
        return tuple(missing)
    denied = []
    for group, resource, verb in missing:
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                  "spec": {"resourceAttributes": {"namespace": namespace, "group": group, "resource": resource, "verb": verb}}}
        if not ((await kube().request("POST", ACCESS_REVIEW, body=review) or {}).get("status") or {}).get("allowed"):
            denied.append((group, resource, verb))
    return tuple(denied)


def needed_by(exp: RLExperiment, denied: Iterable[tuple[str, str, str]]) -> tuple[tuple[str, str, str], ...]:
    """Of the writes denied in its namespace, those this experiment needs: SANDBOX_WRITES only when it runs its tool
    sandbox in pods (a hand-written Role without Deployments blocks those experiments, not every one)."""
    sandbox = sandbox_in_pods(exp)
    return tuple(w for w in denied if sandbox or w not in SANDBOX_WRITES)


RECHECK_FRESH_SECONDS = 5.0
"""A recheck reuses an answer this young: when the operator starts, every experiment of a namespace reconciles at
once, and one review answers them all (a blocked one is retried after CONFIG.retry_delay, 15 s)."""


async def denied_writes(namespace: str, *, recheck: bool = True) -> tuple[tuple[str, str, str], ...]:
    """What the operator may not write in `namespace` (empty: all of WRITES). Asked again when `recheck` (a
    reconcile, and kopf's retry of a blocked one) or after CONFIG.prerequisite_interval, else as last asked."""
    cached = _checked.get(namespace)
    fresh = RECHECK_FRESH_SECONDS if recheck else CONFIG.prerequisite_interval
    if cached is not None and time.monotonic() - cached[0] < fresh:
        return cached[1]
    # One review in flight per namespace: when the answer expires, every tick of the namespace's experiments asks at
    # once (500 experiments sent 150 reviews in 90 s); they all wait for the first one's answer instead.
    key = (namespace, asyncio.get_running_loop())
    pending = _in_flight.get(key)
    if pending is None:
        pending = _in_flight[key] = asyncio.ensure_future(_review(namespace))
        pending.add_done_callback(lambda _: _in_flight.pop(key, None))
    denied = await asyncio.shield(pending)  # a cancelled tick leaves the review to the others
    _checked[namespace] = (time.monotonic(), denied)
    return denied


async def operator_identity() -> str:
    """The operator's user name as the API server sees it (a SelfSubjectReview, asked once)."""
    if not _identity:
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
        answer = await kube().request("POST", SELF_REVIEW, body=body) or {}
        _identity.append(str(((answer.get("status") or {}).get("userInfo") or {}).get("username") or ""))
    return _identity[0]


def grant_command(namespace: str, username: str, cluster_role: str | None = None) -> str:
    """The kubectl command an administrator runs to let the operator work in `namespace`."""
    role = cluster_role or os.environ.get(CLUSTER_ROLE_ENV) or DEFAULT_CLUSTER_ROLE
    prefix = "system:serviceaccount:"
    subject = f"--serviceaccount={username[len(prefix):]}" if username.startswith(prefix) else f"--user={username}"
    return f"kubectl create rolebinding kuberl-operator -n {namespace} --clusterrole={role} {subject}"


def not_permitted_message(namespace: str, denied: Iterable[tuple[str, str, str]], username: str) -> str:
    """The condition and event message: the namespace, what is refused, and the fix."""
    shown = sorted({f"{r}{'.' + g if g else ''}" for g, r, _ in denied})
    return (f"the operator may not create what this experiment runs in namespace {namespace!r} (no RoleBinding there: "
            f"{', '.join(shown)} refused). An administrator allows it with `{grant_command(namespace, username)}`, "
            f"or lists the namespace in the kuberl chart value tenantNamespaces")
