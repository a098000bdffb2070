"""Kueue's real manager (sigs.k8s.io/kueue, built by scripts/install-control-plane.sh) against the test control plane.

    with Kueue(control_plane, workdir) as kq:    # CRDs, webhooks, manager; waits until its webhooks answer
        kq.apply(*kq.queue_objects("team", namespace="ns", quota={"cpu": "8"}))

What a cluster installs through Kueue's manifests, restated for loopback: Kueue's own CRDs (from the Kueue module's
source, config/components/crd/bases) with the conversion webhook its kustomization declares for the CRDs served in two
versions (v1beta1 and v1beta2, v1beta2 stored), and its mutating and validating webhooks, each reached by URL at
https://127.0.0.1:<port> with a CA generated here (Kueue's internal cert management is off; the serving certificate
is written to the manager's certDir, and, through $KUEUE_METRICS_CERT_DIR (the one change the install script makes to
Kueue's main.go), serves its metrics too). The manager runs with the admin kubeconfig (Kueue's RBAC is not what these
tests check), no leader election and no visibility server. Its Configuration (`configuration`): the batch/job
integration, RLExperiment as an external framework (so an experiment's trainer Job, owned by it, is no Kueue workload
of its own), waitForPodsReady on, and manageJobsWithoutQueueName limited to namespaces labelled MANAGED_LABEL. Only the
webhooks of Kueue's own kinds and of Jobs are registered, the Job one for namespaces labelled MANAGED_LABEL: the other
tests' Jobs on the shared control plane never go through Kueue. Stopped by PID; the webhooks are removed first.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Self

import yaml

from kuberl.net import free_port
from kuberl.testing.control_plane import ControlPlane, _die_with_parent, stop_processes

VERSION = "v0.17.0"  # scripts/install-control-plane.sh KUEUE_VERSION
NAMESPACE = "kueue-system"
MANAGED_LABEL = "kuberl.test/kueue-managed"  # namespaces whose unlabelled Jobs Kueue manages (manageJobsWithoutQueueName)
PODS_READY_TIMEOUT = "30s"  # waitForPodsReady: admitted workloads whose pods are not all Ready by then are evicted (room for a busy 2-core CI machine)
EXTERNAL_FRAMEWORK = "RLExperiment.v1alpha1.kuberl.io"
# CRDs served in two versions: Kueue's kustomization gives them the conversion webhook (config/components/crd/patches)
CONVERTED = ("localqueues", "clusterqueues", "cohorts", "workloads", "multikueueclusters")
WEBHOOK_PREFIXES = ("/mutate-kueue-x-k8s-io-", "/validate-kueue-x-k8s-io-", "/mutate-batch-v1-job", "/validate-batch-v1-job")


def source_dir() -> Path:
    """The Kueue module's source in Go's module cache (scripts/install-control-plane.sh downloaded it to build it)."""
    out = subprocess.run(["go", "mod", "download", "-json", f"sigs.k8s.io/kueue@{VERSION}"], capture_output=True, text=True,
                         check=False, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"go mod download sigs.k8s.io/kueue@{VERSION} failed: {out.stderr[-2000:]}")
    return Path(json.loads(out.stdout)["Dir"])


def webhook_pki(folder: Path) -> bytes:
    """A CA and a serving certificate for 127.0.0.1 (tls.crt/tls.key in `folder`, the manager's certDir); returns the
    CA in PEM for the caBundles."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kueue-webhook-ca")])

    def cert(subject: x509.Name, public: Any, ca: bool) -> x509.Certificate:
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(public)
                   .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(hours=1))
                   .not_valid_after(now + dt.timedelta(days=7)))
        if ca:
            builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        else:
            sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(ca_key, hashes.SHA256())

    ca_pem = cert(ca_name, ca_key.public_key(), True).public_bytes(serialization.Encoding.PEM)
    serving = cert(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]), key.public_key(), False)
    (folder / "tls.crt").write_bytes(serving.public_bytes(serialization.Encoding.PEM) + ca_pem)
    (folder / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    (folder / "tls.key").chmod(0o600)
    return ca_pem


def configuration(webhook_port: int, health_port: int, metrics_port: int, cert_dir: Path) -> dict[str, Any]:
    """Kueue's Configuration for these tests (see the module docstring); docs/operations.md names what a cluster needs."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration", "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "clientConnection": {"qps": 50, "burst": 100},
        "manageJobsWithoutQueueName": True,
        "managedJobsNamespaceSelector": {"matchLabels": {MANAGED_LABEL: "true"}},
        "waitForPodsReady": {"timeout": PODS_READY_TIMEOUT, "blockAdmission": False,
                             "requeuingStrategy": {"timestamp": "Eviction", "backoffBaseSeconds": 1, "backoffMaxSeconds": 5}},
        "integrations": {"frameworks": ["batch/job"], "externalFrameworks": [EXTERNAL_FRAMEWORK]},
    }


def crds(src: Path, url: str, ca: bytes) -> list[dict[str, Any]]:
    """Kueue's CRDs, those served in two versions converted by the manager's /convert at `url`."""
    out = []
    for path in sorted((src / "config" / "components" / "crd" / "bases").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["plural"] in CONVERTED:
            crd["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
                "clientConfig": {"url": f"{url}/convert", "caBundle": base64.b64encode(ca).decode()},
                "conversionReviewVersions": ["v1"]}}
        out.append(crd)
    return out


def webhooks(src: Path, url: str, ca: bytes) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, by URL, for Kueue's own kinds and Jobs (the Job ones in MANAGED_LABEL namespaces
    only: the shared control plane's other tests are not Kueue's)."""
    out = []
    for doc in yaml.safe_load_all((src / "config" / "components" / "webhook" / "manifests.yaml").read_text()):
        if not doc:
            continue
        kept = []
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            if not path.startswith(WEBHOOK_PREFIXES):
                continue
            hook["clientConfig"] = {"url": url + path, "caBundle": base64.b64encode(ca).decode()}
            if "batch-v1-job" in path:
                hook["namespaceSelector"] = {"matchLabels": {MANAGED_LABEL: "true"}}
            kept.append(hook)
        doc["webhooks"] = kept
        doc["metadata"]["name"] = f"kueue-{doc['metadata']['name']}"
        out.append(doc)
    return out


class Kueue:
    """Kueue's manager on a ControlPlane; see the module docstring."""

    def __init__(self, cp: ControlPlane, workdir: str | Path, src: Path | None = None):
        self.cp, self.dir = cp, Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.src = src or source_dir()
        self.webhook_port, self.health_port, self.metrics_port = free_port(), free_port(), free_port()
        self.url = f"https://127.0.0.1:{self.webhook_port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.hooks: list[dict[str, Any]] = []

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Install the CRDs, start the manager, register the webhooks once it serves them; waits until a webhook answers."""
        started = time.monotonic()
        binary = self.cp.bin / "kueue-manager"
        if not binary.exists():
            raise RuntimeError(f"{binary} is missing: run `bash scripts/install-control-plane.sh` (it builds Kueue's manager)")
        ca = webhook_pki(self.dir / "certs")
        self.cp.apply(*crds(self.src, self.url, ca))
        self.cp.wait_established(*(f"{crd}.kueue.x-k8s.io" for crd in CONVERTED))
        self.cp.kubectl("create", "namespace", NAMESPACE, check=False)
        config = self.dir / "kueue-config.yaml"
        config.write_text(json.dumps(configuration(self.webhook_port, self.health_port, self.metrics_port, self.dir / "certs")))
        log = (self.dir / "kueue-manager.log").open("ab")
        self.proc = subprocess.Popen([str(binary), f"--config={config}", f"--kubeconfig={self.cp.kubeconfig}",
                                      "--feature-gates=VisibilityOnDemand=false", "--zap-log-level=2"],
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                                     env={**os.environ, "KUEUE_METRICS_CERT_DIR": str(self.dir / "certs")})
        log.close()
        self._wait("the manager's readyz", self._ready)
        self.hooks = webhooks(self.src, self.url, ca)
        self.cp.apply(*self.hooks)
        probe = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "kuberl-probe"}}
        self._wait("Kueue's webhooks answering the API server",
                   lambda: self.cp.kubectl("create", "--dry-run=server", "-f", "-", stdin=json.dumps(probe), check=False).returncode == 0)
        self.touch_crds_once_discovered()
        self.start_seconds = time.monotonic() - started

    def touch_crds_once_discovered(self) -> None:
        """Once discovery serves the Workloads, one more CRD event: kopf re-reads the group's discovery on each CRD event
        only, so an operator whose last CRD event came before the API server's discovery listed Workloads would never
        start its Workload watch (as after `helm install kueue` on a cluster; restarting the operator fixes that)."""
        def served() -> bool:
            out = self.cp.kubectl("get", "--raw", "/apis/kueue.x-k8s.io/v1beta2", check=False)
            return out.returncode == 0 and '"workloads"' in out.stdout
        self._wait("discovery serving kueue.x-k8s.io/v1beta2 workloads", served)
        self.cp.kubectl("annotate", "crd", "workloads.kueue.x-k8s.io", "--overwrite", f"kuberl.test/discovered={time.time():.0f}")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def _wait(self, what: str, check: Any, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"kueue-manager exited with {self.proc.returncode} waiting for {what}:\n{self.log_tail()}")
            if check():
                return
            time.sleep(0.3)
        raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}:\n{self.log_tail()}")

    def stop(self) -> None:
        """Unregister the webhooks (failurePolicy Fail would refuse every later Job and Kueue object), then stop by PID."""
        for hook in self.hooks:
            self.cp.kubectl("delete", hook["kind"].lower(), hook["metadata"]["name"], "--ignore-not-found", check=False)
        self.hooks = []
        if self.proc is not None:
            stop_processes([self.proc])
        self.proc = None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join((self.dir / "kueue-manager.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None
