"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and
KWOK (fake nodes whose pods go Running, Succeeded or Failed without containers), built by
scripts/install-control-plane.sh from the upstream Go modules.

    with ControlPlane(workdir) as cp:      # starts every component, waits until each answers, makes the nodes
        cp.kubeconfig                      # admin (system:masters) kubeconfig
        cp.kubectl("get", "nodes")

The API server serves TLS with a CA of its own (in the kubeconfig), authenticates a static admin token and
ServiceAccount tokens, authorizes with Node,RBAC and runs the default admission plugins (DefaultStorageClass,
ServiceAccount, PodSecurity, ResourceQuota...) and, as GKE does, ExtendedResourceToleration. The controller manager runs every controller but the ones that need
a cloud (node IPAM, cloud node lifecycle, load balancers), each with its own ServiceAccount; KWOK renews the nodes'
leases, so the node lifecycle controller keeps them Ready (and lifts the not-ready taint new nodes get).

Nodes are shaped like real pools (`NODE_POOLS`): CPU nodes, H100 and L4 GPU pools with `nvidia.com/gpu` allocatable and
GKE's taint, an Ascend pool; a default StorageClass and pre-made PersistentVolumes of both access modes, and the
ReadWriteMany classes the examples name. A pod goes
Running and Ready once scheduled. Annotations play its containers (`exit` below): `kwok.kuberl.io/exit-code=N`
makes them exit with N (a pod that restarts, as a StatefulSet's, then waits in CrashLoopBackOff; one that does not
ends Succeeded for 0, else Failed), `kwok.kuberl.io/waiting-reason=R` (on the pod template) keeps a new pod Pending
with its containers waiting for R (ImagePullBackOff...), and `kwok.kuberl.io/message` is the termination or waiting
message. Every process is started with a parent-death signal and stopped by PID.

`python -m kuberl.testing.control_plane` starts one and prints its KUBECONFIG until Ctrl-C.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self

from kuberl.net import free_port
from kuberl.testing.kwok_stages import STAGES

ROOT = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = ROOT / "scripts" / "install-control-plane.sh"
EXIT_CODE_ANNOTATION = "kwok.kuberl.io/exit-code"
WAITING_REASON_ANNOTATION = "kwok.kuberl.io/waiting-reason"
MESSAGE_ANNOTATION = "kwok.kuberl.io/message"
HOLD_TERMINATION_ANNOTATION = "kwok.kuberl.io/hold-termination"
FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
NPU_TAINT = {"key": "huawei.com/Ascend910", "value": "present", "effect": "NoSchedule"}

# name prefix -> (count, labels, taints, allocatable); sized like a small mixed cluster. The GPU pools carry both
# GKE's accelerator label and the `kuberl.io/pool` label the EKS guide puts on its node groups, so that the GKE and
# the EKS examples both find their nodes.
NODE_POOLS: dict[str, tuple[int, dict[str, str], list[dict[str, str]], dict[str, str]]] = {
    "cpu": (3, {"kuberl.test/pool": "cpu"}, [], {"cpu": "32", "memory": "128Gi", "ephemeral-storage": "500Gi", "pods": "110"}),
    "h100": (6, {"kuberl.test/pool": "gpu", "cloud.google.com/gke-accelerator": "nvidia-h100-80gb", "kuberl.io/pool": "h100",
                 "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.present": "true"},
             [GPU_TAINT], {"cpu": "208", "memory": "1872Gi", "ephemeral-storage": "6Ti", "pods": "110", "nvidia.com/gpu": "8"}),
    "l4": (2, {"kuberl.test/pool": "gpu", "cloud.google.com/gke-accelerator": "nvidia-l4", "kuberl.io/pool": "l4",
               "nvidia.com/gpu.product": "NVIDIA-L4", "nvidia.com/gpu.present": "true"},
           [GPU_TAINT], {"cpu": "96", "memory": "384Gi", "ephemeral-storage": "3Ti", "pods": "110", "nvidia.com/gpu": "8"}),
    # Multi-node fabric pools (examples/gke-a3-tcpxo.yaml, examples/eks-p5-efa.yaml): GKE's A3 Mega (GPUDirect-TCPXO, 8 GPU
    # NICs as multi-network interfaces: nothing the scheduler counts) and EKS's p5.48xlarge with the EFA device plugin's
    # 32 vpc.amazonaws.com/efa and the 2 MiB hugepages the EFA installer reserves.
    "a3mega": (2, {"kuberl.test/pool": "fabric", "cloud.google.com/gke-accelerator": "nvidia-h100-mega-80gb",
                   "node.kubernetes.io/instance-type": "a3-megagpu-8g", "nvidia.com/gpu.present": "true"},
               [GPU_TAINT], {"cpu": "208", "memory": "1872Gi", "ephemeral-storage": "6Ti", "pods": "110", "nvidia.com/gpu": "8"}),
    "p5": (2, {"kuberl.test/pool": "fabric", "kuberl.io/pool": "p5", "node.kubernetes.io/instance-type": "p5.48xlarge",
               "nvidia.com/gpu.present": "true"},
           [GPU_TAINT], {"cpu": "192", "memory": "2000Gi", "ephemeral-storage": "7Ti", "pods": "100", "nvidia.com/gpu": "8",
                         "vpc.amazonaws.com/efa": "32", "hugepages-2Mi": "10256Mi"}),
    "npu": (2, {"kuberl.test/pool": "npu", "accelerator": "huawei-Ascend910"},
            [NPU_TAINT], {"cpu": "192", "memory": "1536Gi", "ephemeral-storage": "2Ti", "pods": "110", "huawei.com/Ascend910": "8"}),
}
STORAGE_CLASS = "standard"
# Classes the examples name for ReadWriteMany checkpoints (GKE Filestore, EKS EFS, CephFS), each with volumes of its own.
RWX_STORAGE_CLASSES = ("standard-rwx", "efs-kuberl", "cephfs")
VOLUMES_PER_MODE = 256  # pre-made PVs per access mode of the default class (no provisioner runs; Retain: a released PV is not
# reused). The e2e tier makes more experiments than 64 on one control plane, each with an RWO bus claim and an RWX
# checkpoint claim: at 64 the last ones (test_operator_restarts, in the suite of 2026-12-03) waited for a volume forever.
VOLUMES_PER_RWX_CLASS = 12

# The API server's audit log (`audit_events`): every request on KubeRL's and Kueue's resources, so a test can count
# what a client (the operator) asked of the API; nothing else (the controllers' traffic would fill it).
AUDIT_POLICY = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"], "rules": [
    {"level": "Metadata", "resources": [{"group": "kuberl.io"}, {"group": "kueue.x-k8s.io"}]},
    {"level": "Metadata", "verbs": ["list", "watch"], "resources": [{"group": "", "resources": ["nodes"]}]},  # who reads Nodes how
    {"level": "None"}]}


# What the session's control-plane fixtures started, stopped in reverse once the last test that uses them has run
# (the root conftest.py's hook, under xdist's loadgroup, where those tests run one after another on one worker): an idle
# API server and operator otherwise keep a third of a core busy until the whole session ends.
SESSION_STOPS: list[Callable[[], None]] = []
STOPPED_EARLY: list[bool] = []  # non-empty once stop_session_services ran


def stop_session_services() -> None:
    """Stop what SESSION_STOPS holds, last registered first (Kueue, the operator, then the control plane)."""
    while SESSION_STOPS:
        SESSION_STOPS.pop()()
    STOPPED_EARLY.append(True)


def crd_established(kubectl: Callable[..., subprocess.CompletedProcess[str]], crd: str) -> bool:
    """Whether a CRD reports Established=True, read with `kubectl(*args, check=False)` (a ControlPlane's or a cluster's)."""
    out = kubectl("get", f"crd/{crd}", "-o", "jsonpath={.status.conditions[?(@.type=='Established')].status}", check=False)
    return out.returncode == 0 and out.stdout.strip() == "True"


def stop_processes(procs: list[subprocess.Popen[Any]], grace: float = 15) -> None:
    """Stop by PID: SIGTERM to all at once, then each gets `grace` seconds before SIGKILL."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def install(check_only: bool = False) -> Path:
    """The folder of the built binaries: scripts/install-control-plane.sh builds what is missing (cached)."""
    args = ["bash", str(INSTALL_SCRIPT), *(["--bin-dir"] if check_only else [])]
    out = subprocess.run(args, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def _die_with_parent() -> None:  # preexec_fn: SIGKILL when the process that started us dies (Linux prctl)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _pki(folder: Path) -> dict[str, Path]:
    """A CA, the API server's serving certificate (127.0.0.1, localhost) and the ServiceAccount signing key."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import NameOID

    def pem_key(key: Any) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kuberl-test-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(hours=1))
          .not_valid_after(now + dt.timedelta(days=7)).add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName("localhost"), x509.DNSName("kubernetes.default.svc"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=7))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False).sign(ca_key, hashes.SHA256()))
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    paths = {n: folder / f for n, f in (("ca", "ca.crt"), ("cert", "apiserver.crt"), ("key", "apiserver.key"),
                                         ("sa_key", "sa.key"), ("sa_pub", "sa.pub"))}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(pem_key(key))
    paths["sa_key"].write_bytes(pem_key(sa_key))
    paths["sa_pub"].write_bytes(sa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                 serialization.PublicFormat.SubjectPublicKeyInfo))
    for p in paths.values():
        p.chmod(0o600)
    return paths


def kubeconfig_text(server: str, ca: Path, user: str, token: str) -> str:
    import base64
    return json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": user,
        "clusters": [{"name": "kuberl-test", "cluster": {"server": server,
                                                        "certificate-authority-data": base64.b64encode(ca.read_bytes()).decode()}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "kuberl-test", "user": user}}],
    }, indent=1)


class ControlPlane:
    """Start with `with ControlPlane(workdir) as cp:`; see the module docstring."""

    def __init__(self, workdir: str | Path, bin_dir: Path | None = None, *, nodes: bool = True,
                 audit_rules: Sequence[dict[str, Any]] = ()):
        self.dir = Path(workdir)
        # Audit policy rules ahead of AUDIT_POLICY's (bench/bench_operator_scale.py: every request of the operator's account).
        self.audit_rules = list(audit_rules)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.bin = bin_dir or install()
        self.make_nodes = nodes
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.etcd_port, self.etcd_peer_port, self.port = free_port(), free_port(), free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        self.kubeconfig = str(self.dir / "admin.kubeconfig")
        self.admin_token = os.urandom(16).hex()
        self.audit_log = self.dir / "audit.log"

    # -- processes ------------------------------------------------------------------------------------
    def _spawn(self, name: str, args: Sequence[str]) -> subprocess.Popen[bytes]:
        log = (self.dir / f"{name}.log").open("ab")
        proc = subprocess.Popen([str(self.bin / args[0]), *args[1:]], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent, cwd=self.dir)
        log.close()
        self.procs.append((name, proc))
        return proc

    def log_tail(self, name: str, lines: int = 30) -> str:
        try:
            return "\n".join((self.dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _wait(self, what: str, check: Any, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}:\n{self.log_tail(name)}")
            if check():
                return
            time.sleep(0.3)
        raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}\n" +
                           "\n".join(f"--- {n} ---\n{self.log_tail(n, 15)}" for n, _ in self.procs))

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([str(self.bin / "kubectl"), "--kubeconfig", self.kubeconfig, *args], input=stdin,
                             capture_output=True, text=True, timeout=timeout, check=False)
        if check and out.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
        return out

    def apply(self, *objects: dict[str, Any]) -> None:
        self.kubectl("apply", "--server-side", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}))

    def wait_established(self, *crds: str, timeout: float = 60) -> None:
        """Wait until each CRD reports Established=True. Polled rather than `kubectl wait --for=condition=Established`:
        that one fails at once (".status.conditions accessor error") when it reads a CRD created a moment ago whose
        status the apiextensions controller has not written yet."""
        for crd in crds:
            self._wait(f"CRD {crd} Established", lambda crd=crd: crd_established(self.kubectl, crd), timeout)

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
        started = time.monotonic()
        pki = _pki(self.dir)
        (self.dir / "tokens.csv").write_text(f"{self.admin_token},kuberl-admin,kuberl-admin,system:masters\n")
        (self.dir / "tokens.csv").chmod(0o600)
        (self.dir / "audit-policy.yaml").write_text(json.dumps({**AUDIT_POLICY, "rules": [*self.audit_rules, *AUDIT_POLICY["rules"]]}))
        self._spawn("etcd", ["etcd", "--data-dir", str(self.dir / "etcd"), "--name", "default",
                             "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                             "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                             "--listen-peer-urls", f"http://127.0.0.1:{self.etcd_peer_port}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.etcd_peer_port}",
                             "--initial-cluster", f"default=http://127.0.0.1:{self.etcd_peer_port}",
                             "--unsafe-no-fsync", "--quota-backend-bytes", str(2 << 30)])
        self._spawn("kube-apiserver", [
            "kube-apiserver", f"--etcd-servers=http://127.0.0.1:{self.etcd_port}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={self.port}", f"--tls-cert-file={pki['cert']}",
            f"--tls-private-key-file={pki['key']}", f"--token-auth-file={self.dir / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC", "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={pki['sa_pub']}", f"--service-account-signing-key-file={pki['sa_key']}",
            "--service-cluster-ip-range=10.96.0.0/16", "--endpoint-reconciler-type=none", "--allow-privileged=true",
            f"--cert-dir={self.dir / 'pki'}", "--enable-priority-and-fairness=true", "--profiling=false",
            # GKE's: a pod that requests nvidia.com/gpu tolerates the GPU nodes' taint of that name.
            "--enable-admission-plugins=ExtendedResourceToleration",
            f"--audit-policy-file={self.dir / 'audit-policy.yaml'}", f"--audit-log-path={self.audit_log}", "--audit-log-format=json",
        ])
        (Path(self.kubeconfig)).write_text(kubeconfig_text(self.server, pki["ca"], "kuberl-admin", self.admin_token))
        Path(self.kubeconfig).chmod(0o600)
        self._wait("kube-apiserver /readyz", lambda: self.kubectl("get", "--raw", "/readyz", check=False, timeout=10).returncode == 0)
        self._spawn("kube-controller-manager", [
            "kube-controller-manager", f"--kubeconfig={self.kubeconfig}", f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}", "--leader-elect=false", "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}", f"--service-account-private-key-file={pki['sa_key']}", f"--root-ca-file={pki['ca']}",
            "--use-service-account-credentials=true", "--controllers=*,-node-ipam-controller,-cloud-node-lifecycle-controller,-service-lb-controller",
            "--concurrent-statefulset-syncs=5", "--concurrent-job-syncs=5",
        ])
        self._spawn("kube-scheduler", [
            "kube-scheduler", f"--kubeconfig={self.kubeconfig}", f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}", "--leader-elect=false", "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
        ])
        (self.dir / "kwok.yaml").write_text(STAGES)
        self._spawn("kwok", ["kwok", f"--kubeconfig={self.kubeconfig}", f"--config={self.dir / 'kwok.yaml'}",
                             "--manage-all-nodes=false", f"--manage-nodes-with-annotation-selector={FAKE_NODE_ANNOTATION}=fake",
                             f"--server-address=127.0.0.1:{free_port()}", "--node-ip=10.0.0.1", "--cidr=10.0.0.1/16",
                             "--node-lease-duration-seconds=40"])  # renewed every 10 s, as a kubelet does
        # The namespace controller and the ServiceAccount controller answer: `default` has its ServiceAccount.
        self._wait("the default ServiceAccount", lambda: self.kubectl("get", "serviceaccount", "default", check=False).returncode == 0)
        if self.make_nodes:
            self.add_nodes()
            self.add_storage()
        self.start_seconds = time.monotonic() - started

    def stop(self) -> None:
        stop_processes([proc for _, proc in reversed(self.procs)])
        self.procs.clear()

    # -- cluster contents -----------------------------------------------------------------------------
    def add_nodes(self, pools: dict[str, tuple[int, dict[str, str], list[dict[str, str]], dict[str, str]]] = NODE_POOLS) -> list[str]:
        """Fake nodes, `<pool>-<i>`, with their allocatable set as a kubelet would report it; waits until all are Ready."""
        names, nodes, statuses = [], [], []
        for pool, (count, labels, taints, allocatable) in pools.items():
            for i in range(count):
                name = f"{pool}-{i}"
                names.append(name)
                nodes.append({"apiVersion": "v1", "kind": "Node",
                              "metadata": {"name": name, "annotations": {FAKE_NODE_ANNOTATION: "fake"},
                                           "labels": {**labels, "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                                      "kubernetes.io/arch": "amd64", "type": "kwok"}},
                              "spec": {"taints": taints}})
                statuses.append((name, {"status": {"allocatable": allocatable, "capacity": allocatable}}))
        self.apply(*nodes)
        for name, status in statuses:  # what a kubelet reports (the status subresource: not part of the create)
            self.kubectl("patch", "node", name, "--subresource=status", "--type=merge", "-p", json.dumps(status))

        def all_ready() -> bool:
            got = json.loads(self.kubectl("get", "nodes", "-o", "json").stdout)["items"]
            ready = {n["metadata"]["name"] for n in got
                     if any(c["type"] == "Ready" and c["status"] == "True" for c in n.get("status", {}).get("conditions", []))}
            return set(names) <= ready
        self._wait("the fake nodes Ready", all_ready)
        return names

    def add_storage(self, per_mode: int = VOLUMES_PER_MODE) -> None:
        """A default StorageClass (no provisioner, binding at once) with pre-made volumes for RWO and RWX claims, and
        the RWX classes the examples name, each with volumes of its own."""
        def storage_class(name: str, default: bool) -> dict[str, Any]:
            return {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
                    "metadata": {"name": name, "annotations": {"storageclass.kubernetes.io/is-default-class": str(default).lower()}},
                    "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "Immediate", "allowVolumeExpansion": True}

        def volume(name: str, mode: str, cls: str) -> dict[str, Any]:
            return {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
                    "spec": {"capacity": {"storage": "16Ti"}, "accessModes": [mode], "storageClassName": cls,
                             "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": f"/kuberl-fake-volumes/{name}"}}}

        objs = [storage_class(STORAGE_CLASS, True), *(storage_class(c, False) for c in RWX_STORAGE_CLASSES)]
        objs += [volume(f"pv-{mode.lower()}-{i}", mode, STORAGE_CLASS) for mode in ("ReadWriteOnce", "ReadWriteMany") for i in range(per_mode)]
        objs += [volume(f"pv-{c}-{i}", "ReadWriteMany", c) for c in RWX_STORAGE_CLASSES for i in range(VOLUMES_PER_RWX_CLASS)]
        self.apply(*objs)

    def exit(self, namespace: str, pods: Sequence[str], code: int, message: str = "") -> None:
        """Make the pods' containers exit with `code` (and `message` as their termination message), as a kubelet
        would report it: KWOK's pod-exit stage reads these annotations."""
        for pod in pods:
            self.kubectl("annotate", "pod", pod, "-n", namespace, "--overwrite", f"{MESSAGE_ANNOTATION}={message}",
                         f"{EXIT_CODE_ANNOTATION}={code}")

    def hold_termination(self, namespace: str, pods: Sequence[str], hold: bool = True) -> None:
        """A deleted pod stays terminating while held (a long grace period, a node that stopped answering); released
        (hold=False), KWOK finishes its deletion."""
        value = f"{HOLD_TERMINATION_ANNOTATION}=true" if hold else f"{HOLD_TERMINATION_ANNOTATION}-"
        for pod in pods:
            self.kubectl("annotate", "pod", pod, "-n", namespace, "--overwrite", value)

    def session(self) -> Any:
        """A requests.Session acting as the admin: the bearer token, TLS checked against this cluster's CA."""
        import requests

        http = requests.Session()
        http.headers["Authorization"] = f"Bearer {self.admin_token}"
        http.verify = str(self.dir / "ca.crt")
        http.trust_env = False  # $REQUESTS_CA_BUNDLE would otherwise win over `verify` (and no proxy for loopback)
        return http

    def audit_events(self) -> list[dict[str, Any]]:
        """The audit log's events so far (AUDIT_POLICY: requests on kuberl.io and kueue.x-k8s.io resources, lists and watches of
        Nodes), oldest first:
        each has verb, user.username, objectRef (resource, namespace, name, subresource), responseStatus.code."""
        try:
            lines = self.audit_log.read_text().splitlines()
        except FileNotFoundError:
            return []
        events = []
        for line in lines:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:  # the line being written
                break
        return events

    def token_for(self, service_account: str, namespace: str, duration: str = "24h") -> str:
        """A bound token of a ServiceAccount (`kubectl create token`), to act with its RBAC."""
        return self.kubectl("create", "token", service_account, "-n", namespace, f"--duration={duration}").stdout.strip()

    def kubeconfig_for(self, service_account: str, namespace: str, path: Path) -> str:
        path.write_text(kubeconfig_text(self.server, self.dir / "ca.crt", f"{namespace}-{service_account}",
                                        self.token_for(service_account, namespace)))
        path.chmod(0o600)
        return str(path)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import tempfile
    p = argparse.ArgumentParser(prog="python -m kuberl.testing.control_plane", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="Working folder (default: a new temporary one)")
    args = p.parse_args(argv)
    workdir = args.dir or tempfile.mkdtemp(prefix="kuberl-control-plane-")
    with ControlPlane(workdir) as cp:
        print(f"control plane up in {cp.start_seconds:.1f} s; binaries in {cp.bin}", flush=True)
        print(f"export KUBECONFIG={cp.kubeconfig}\nexport PATH={cp.bin}:$PATH", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
