"""Admission parity (issue #36): the real API server and `kuberl validate` must admit and reject the same manifests.

Each manifest of kuberl.testing.admission_fuzz goes to the API server as a dry-run create
(`POST .../rlexperiments?dryRun=All&fieldValidation=Strict`: nothing is stored; Strict because `kubectl apply` asks for
it by default since Kubernetes 1.27, and because `kuberl validate` reports unknown fields as errors: under Warn or
Ignore they would be dropped and the object admitted) and to `kuberl.api.validation.check_admission` (strict decoding,
pruning, defaulting, the openAPIV3Schema, the CEL rules). The two decisions must agree on every manifest. Where both
admit, `check_models` (the pydantic models: what the operator would fail later) may still reject: those are counted
by message class, to show each is one admission cannot express. Error field paths are compared too (informational).

Used by bench/admission_parity.py (10,000 manifests) and tests/integration/test_admission_parity.py (a sample).
"""

from __future__ import annotations

import base64
import json
import re
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import yaml

from kuberl.api import validation
from kuberl.api.crd import build_crd
from kuberl.api.v1alpha1 import GROUP, PLURAL, VERSION
from kuberl.testing.admission_fuzz import NAMESPACE, Case

CRD_NAME = f"{PLURAL}.{GROUP}"
FIELD_MANAGER = "kuberl-admission-parity"


class ApiServer:
    """An API server reached with a bearer token (or a client certificate) over TLS; one keep-alive Session per thread."""

    def __init__(self, server: str, ca: str | Path | bool, token: str | None = None, cert: tuple[str, str] | None = None):
        self.server, self.ca, self.token, self.cert = server.rstrip("/"), str(ca) if not isinstance(ca, bool) else ca, token, cert
        self._local = threading.local()

    @classmethod
    def from_control_plane(cls, cp: Any) -> ApiServer:
        return cls(cp.server, cp.dir / "ca.crt", token=cp.admin_token)

    @classmethod
    def from_kubeconfig(cls, path: str | Path) -> ApiServer:
        """The current context of a kubeconfig: server, CA and a token or client certificate (inline data or files)."""
        conf = yaml.safe_load(Path(path).read_text())
        ctx = next(c["context"] for c in conf["contexts"] if c["name"] == conf["current-context"])
        cluster = next(c["cluster"] for c in conf["clusters"] if c["name"] == ctx["cluster"])
        user = next(u["user"] for u in conf["users"] if u["name"] == ctx["user"])

        def file_of(key: str) -> str | None:
            if f"{key}-data" in cluster or f"{key}-data" in user:
                data = base64.b64decode(cluster.get(f"{key}-data") or user[f"{key}-data"])
                out = tempfile.NamedTemporaryFile(prefix="kuberl-parity-", delete=False)
                out.write(data)
                out.close()
                return out.name
            return cluster.get(key) or user.get(key)

        ca = file_of("certificate-authority") or (not cluster.get("insecure-skip-tls-verify", False))
        cert, key = file_of("client-certificate"), file_of("client-key")
        return cls(cluster["server"], ca, token=user.get("token"), cert=(cert, key) if cert and key else None)

    @property
    def session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
            s.trust_env = False  # REQUESTS_CA_BUNDLE would win over `verify`, a proxy variable would catch loopback
            s.verify = self.ca
            s.cert = self.cert
            if self.token:
                s.headers["Authorization"] = f"Bearer {self.token}"
        return s

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json", **params: str) -> requests.Response:
        data = body if isinstance(body, str | bytes) or body is None else json.dumps(body)
        return self.session.request(method, self.server + path, data=data, params=params, timeout=60, headers={"Content-Type": content_type})

    def install_crd(self, crd: dict[str, Any] | None = None, timeout: float = 60, apply: bool = True) -> None:
        """Server-side apply the CRD (as `kubectl apply --server-side --force-conflicts`; apply=False: use the one there),
        wait until it is Established and its schema answers, and make the namespace the manifests go to."""
        if apply:
            r = self.request("PATCH", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}", crd or build_crd(),
                             content_type="application/apply-patch+yaml", fieldManager=FIELD_MANAGER, force="true")
            if r.status_code != 200 and r.status_code != 201:
                raise RuntimeError(f"the API server refused the CRD ({r.status_code}): {r.text[:4000]}")
        r = self.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        if r.status_code not in (201, 409):
            r.raise_for_status()
        deadline = time.monotonic() + timeout
        probe = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "RLExperiment", "metadata": {"name": "probe"},
                 "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "add-small"}, "admissionParityProbe": 1}}
        while True:  # Established, then the new schema in force: the probe's unknown field is refused
            got = self.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}").json()
            established = any(c["type"] == "Established" and c["status"] == "True" for c in (got.get("status") or {}).get("conditions") or [])
            valid = {**probe, "spec": {k: v for k, v in probe["spec"].items() if k != "admissionParityProbe"}}
            if established and self.dry_run_create(probe).code == 400 and self.dry_run_create(valid).code == 201:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRD {CRD_NAME} not Established and serving within {timeout:.0f} s: {got.get('status')}")
            time.sleep(0.5)

    def dry_run_create(self, doc: Any) -> ServerVerdict:
        r = self.request("POST", f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}", doc, dryRun="All", fieldValidation="Strict")
        return ServerVerdict.of(r)


@dataclass(frozen=True)
class ServerVerdict:
    """The API server's answer: HTTP code, message and the field paths it names."""

    code: int
    message: str
    paths: frozenset[str]

    @property
    def admitted(self) -> bool:
        return self.code == 201

    @property
    def rejected(self) -> bool:
        return self.code in (400, 422)

    @classmethod
    def of(cls, r: requests.Response) -> ServerVerdict:
        if r.status_code == 201:
            return cls(201, "", frozenset())
        try:
            status = r.json()
        except ValueError:
            return cls(r.status_code, r.text[:2000], frozenset())
        msg = status.get("message", "")
        # "<nil>" is the note "some validation rules were not checked because the object was invalid", no field
        paths = {c["field"] for c in (status.get("details") or {}).get("causes", []) if c.get("field") and c["field"] != "<nil>"}
        paths |= set(re.findall(r'unknown field "([^"]*)"', msg))
        paths |= {f"metadata.{f}" for f in re.findall(r"into Go struct field ObjectMeta\.(\w+) of type", msg)}
        return cls(r.status_code, msg, frozenset(paths))


def message_class(error: validation.ValidationError) -> str:
    """An error's path and message with the values taken out (quoted text, numbers), so alike errors group together."""
    path = re.sub(r"\[\d+\]", "[*]", error.path)
    msg = re.sub(r"(?<![A-Za-z])\d+", "N", re.sub(r"'[^']*'", "'…'", error.message))
    return f"{path}: {msg}"


@dataclass
class Report:
    total: int = 0
    admitted_by_both: int = 0
    rejected_by_both: int = 0
    disagreements: list[dict[str, Any]] = field(default_factory=list)
    server_errors: list[dict[str, Any]] = field(default_factory=list)  # neither admitted nor rejected (5xx, 404...): the harness's problem
    model_only: Counter[str] = field(default_factory=Counter)  # admitted by both, rejected by the models: message classes
    model_only_examples: dict[str, int] = field(default_factory=dict)  # message class -> first case index
    paths_equal: int = 0  # both rejected: the same set of field paths
    paths_overlap: int = 0  # both rejected: at least one path in common (equal sets included)
    kinds: Counter[str] = field(default_factory=Counter)  # mutation kind -> cases
    seconds: float = 0.0
    validate_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.disagreements and not self.server_errors

    def text(self) -> str:
        both = max(self.rejected_by_both, 1)
        lines = [
            f"manifests:            {self.total} in {self.seconds:.1f} s ({self.total / max(self.seconds, 1e-9):.0f}/s; "
            f"kuberl validate {self.validate_seconds:.1f} s of it)",
            f"admitted by both:     {self.admitted_by_both}",
            f"rejected by both:     {self.rejected_by_both} (error paths: equal sets {self.paths_equal} = {self.paths_equal / both:.0%}, "
            f"overlapping {self.paths_overlap} = {self.paths_overlap / both:.0%})",
            f"disagreements:        {len(self.disagreements)}",
            f"server errors:        {len(self.server_errors)}",
            f"admitted, models reject (the operator would fail them later): {sum(self.model_only.values())} in {len(self.model_only)} classes",
        ]
        lines += [f"  {n:5d}  {cls}  (e.g. case {self.model_only_examples[cls]})" for cls, n in self.model_only.most_common()]
        lines.append("mutation kinds: " + ", ".join(f"{k} {n}" for k, n in sorted(self.kinds.items())))
        return "\n".join(lines)


def compare(case: Case, verdict: ServerVerdict, report: Report) -> None:
    """Add one manifest's two decisions to the report."""
    errors, stored = validation.check_admission(case.doc)
    report.total += 1
    report.kinds.update(set(case.kinds))
    record = {"index": case.index, "source": case.source, "mutations": list(case.mutations), "server_code": verdict.code,
              "server_message": verdict.message[:4000], "validate": [str(e)[:1000] for e in errors], "doc": case.doc}
    if not verdict.admitted and not verdict.rejected:
        report.server_errors.append(record)
    elif verdict.admitted != (stored is not None):
        report.disagreements.append(record)
    elif verdict.admitted:
        report.admitted_by_both += 1
        for e in validation.check_models(stored):
            cls = message_class(e)
            report.model_only[cls] += 1
            report.model_only_examples.setdefault(cls, case.index)
    else:
        report.rejected_by_both += 1
        ours = {e.path for e in errors}
        unknown = {e.path for e in errors if e.kind == "unknown field"}
        if verdict.code == 400 and unknown:  # the server stopped at strict decoding; ours goes on to the schema
            ours = unknown
        report.paths_equal += ours == verdict.paths
        report.paths_overlap += bool(ours & verdict.paths)


def run(api: ApiServer, cases: Iterable[Case], workers: int = 4, window: int = 64) -> Report:
    """Every case through the API server (`workers` requests in flight) and through check_admission (this thread)."""
    report = Report()
    started = time.monotonic()
    pending: list[tuple[Case, Any]] = []
    with ThreadPoolExecutor(workers, thread_name_prefix="dry-run") as pool:
        def drain(keep: int) -> None:
            while len(pending) > keep:
                case, fut = pending.pop(0)
                verdict = fut.result()
                t = time.monotonic()
                compare(case, verdict, report)
                report.validate_seconds += time.monotonic() - t
        for case in cases:
            pending.append((case, pool.submit(api.dry_run_create, case.doc)))
            drain(window)
        drain(0)
    report.seconds = time.monotonic() - started
    return report
