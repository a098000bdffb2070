#!/usr/bin/env bash
# KubeRL on a real Kubernetes cluster (kind), the way docs/operations.md tells a newcomer to run it:
# build the operator and CPU runtime images, start a kind cluster, load the images into it, install
# the Helm chart, run the e2e tests with KUBECONFIG pointing at it, then run
# examples/quickstart-cpu.yaml until it has trained some steps. .github/workflows/e2e-kind.yml runs
# exactly these steps, one per workflow step. Needs Docker (with buildx), Python >= 3.11 and pip.
#
#   bash scripts/e2e-kind.sh tools              # optional: pinned kind, kubectl, helm into $KUBERL_E2E_DIR/bin
#   bash scripts/e2e-kind.sh all                # deps build cluster load install test quickstart
#   bash scripts/e2e-kind.sh build load install # any steps, in the order given
#   bash scripts/e2e-kind.sh dump               # after a failure: describe, events, every pod's log
#   bash scripts/e2e-kind.sh down               # delete the kind cluster
#
# It never touches your own kubeconfig: the cluster's lands in $KUBERL_E2E_DIR/kubeconfig
# (`export KUBECONFIG=$KUBERL_E2E_DIR/kubeconfig` to look around). Settings (environment):
#   KUBERL_E2E_REGISTRY   images <REGISTRY>/operator:<version>, <REGISTRY>/runtime-cpu:<version> (kuberl.local)
#   KUBERL_E2E_PLATFORM   image platform (default: the Docker engine's, e.g. linux/amd64)
#   KUBERL_E2E_DIR        tools, kubeconfig, logs (default: $RUNNER_TEMP or /tmp, /kuberl-e2e-kind)
#   KUBERL_KIND_CLUSTER   cluster name (kuberl-e2e)
#   QUICKSTART_STEPS      progress.step the quickstart must reach (3); QUICKSTART_TIMEOUT seconds (1500)
#   QUICKSTART_NAMESPACE  where the quickstart runs (default)
#   PYTHON                the Python that runs pip and pytest (python3)
set -euo pipefail
cd "$(dirname "$0")/.."

# Pinned tools. The node image is the one kind v0.30.0 was released with (its release notes give the digest).
KIND_VERSION="${KIND_VERSION:-v0.30.0}"
KIND_NODE_IMAGE="${KIND_NODE_IMAGE:-kindest/node:v1.34.0@sha256:7416a61b42b1662ca6ca89f02028ac133a309a2a30ba309614e8ec94d976dc5a}"
KUBECTL_VERSION="${KUBECTL_VERSION:-v1.34.0}"
HELM_VERSION="${HELM_VERSION:-v3.18.6}"

PY="${PYTHON:-python3}"
CLUSTER="${KUBERL_KIND_CLUSTER:-kuberl-e2e}"
WORK="${KUBERL_E2E_DIR:-${RUNNER_TEMP:-${TMPDIR:-/tmp}}/kuberl-e2e-kind}"
# docker-bake.hcl's REGISTRY: a name no registry answers to; the images reach the node by `kind load`.
REGISTRY="${KUBERL_E2E_REGISTRY:-kuberl.local}"
# docker-bake.hcl's VERSION, the package version: the operator asks for runtime images tagged with its own.
VERSION="$("$PY" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')"
OPERATOR_IMAGE="${REGISTRY}/operator:${VERSION}"
# What the operator renders for accelerator type cpu: <runtimeImages.repository>/runtime-cpu:<version>.
RUNTIME_IMAGE="${REGISTRY}/runtime-cpu:${VERSION}"
RELEASE=kuberl
OPERATOR_NAMESPACE=kuberl-system
E2E_NAMESPACE="${KUBERL_E2E_NAMESPACE:-kuberl-e2e}"
QUICKSTART=examples/quickstart-cpu.yaml
QUICKSTART_NAMESPACE="${QUICKSTART_NAMESPACE:-default}"
QUICKSTART_STEPS="${QUICKSTART_STEPS:-3}"
QUICKSTART_TIMEOUT="${QUICKSTART_TIMEOUT:-1500}"

mkdir -p "$WORK/bin"
export PATH="$WORK/bin:$PATH"
export KUBECONFIG="$WORK/kubeconfig"
export KUBERL_E2E_NAMESPACE="$E2E_NAMESPACE"

log() { printf '\n=== %s\n' "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }
need() { command -v "$1" >/dev/null 2>&1 || die "$1 is not on PATH: $2"; }

# Points $KUBECONFIG at the kind cluster (kind writes it; nothing else is read or changed).
use_cluster() {
  need kind "bash scripts/e2e-kind.sh tools, or https://kind.sigs.k8s.io"
  kind get clusters 2>/dev/null | grep -qx "$CLUSTER" || die "no kind cluster $CLUSTER: run bash scripts/e2e-kind.sh cluster first"
  kind export kubeconfig --name "$CLUSTER" --kubeconfig "$KUBECONFIG" >/dev/null 2>&1
}

platform() {
  if [ -n "${KUBERL_E2E_PLATFORM:-}" ]; then echo "$KUBERL_E2E_PLATFORM"; return; fi
  echo "linux/$(docker version --format '{{.Server.Arch}}')"
}

# Downloads $1 to $2 and checks it against the sha256 published next to it ($3: its URL).
fetch() {
  local url="$1" dest="$2" sum_url="$3" want got
  curl -fsSL --retry 3 -o "$dest.tmp" "$url"
  want="$(curl -fsSL --retry 3 "$sum_url" | awk '{print $1}')"
  [ -n "$want" ] || die "no checksum at $sum_url"
  if command -v sha256sum >/dev/null 2>&1; then got="$(sha256sum "$dest.tmp")"; else got="$(shasum -a 256 "$dest.tmp")"; fi
  [ "${got%% *}" = "$want" ] || die "checksum mismatch for $url: got ${got%% *}, published $want"
  mv "$dest.tmp" "$dest"
}

step_tools() {
  local os arch tmp
  os="$(uname -s | tr '[:upper:]' '[:lower:]')"
  case "$(uname -m)" in x86_64 | amd64) arch=amd64 ;; aarch64 | arm64) arch=arm64 ;; *) die "unsupported machine $(uname -m)" ;; esac
  log "tools: kind $KIND_VERSION, kubectl $KUBECTL_VERSION, helm $HELM_VERSION -> $WORK/bin"
  fetch "https://dl.k8s.io/release/${KUBECTL_VERSION}/bin/${os}/${arch}/kubectl" "$WORK/bin/kubectl" \
    "https://dl.k8s.io/release/${KUBECTL_VERSION}/bin/${os}/${arch}/kubectl.sha256"
  fetch "https://github.com/kubernetes-sigs/kind/releases/download/${KIND_VERSION}/kind-${os}-${arch}" "$WORK/bin/kind" \
    "https://github.com/kubernetes-sigs/kind/releases/download/${KIND_VERSION}/kind-${os}-${arch}.sha256sum"
  tmp="$(mktemp -d)"
  fetch "https://get.helm.sh/helm-${HELM_VERSION}-${os}-${arch}.tar.gz" "$tmp/helm.tar.gz" \
    "https://get.helm.sh/helm-${HELM_VERSION}-${os}-${arch}.tar.gz.sha256sum"
  tar -xzf "$tmp/helm.tar.gz" -C "$tmp"
  mv "$tmp/${os}-${arch}/helm" "$WORK/bin/helm"
  rm -rf "$tmp"
  chmod +x "$WORK/bin/kubectl" "$WORK/bin/kind" "$WORK/bin/helm"
  kind version
  kubectl version --client
  helm version --short
}

# What the e2e tests import (pytest, pyyaml; kuberl itself for `kuberl validate` and the manifest check).
step_deps() {
  log "deps: pytest and kuberl into $("$PY" -c 'import sys; print(sys.executable)')"
  "$PY" -m pip install --upgrade pip
  "$PY" -m pip install "pytest>=8" "pytest-timeout>=2.3" "pytest-asyncio>=0.24" "pyyaml>=6" -e .
}

step_build() {
  need docker "install Docker with the buildx plugin"
  local plat
  plat="$(platform)"
  log "build: $OPERATOR_IMAGE and $RUNTIME_IMAGE for $plat (docker-bake.hcl)"
  # One platform (--load cannot load a multi-platform image); no provenance attestation (kind load
  # imports plain single-platform images).
  REGISTRY="$REGISTRY" VERSION="$VERSION" docker buildx bake --load --provenance=false \
    --set "*.platform=$plat" operator runtime-cpu
  docker image ls --filter "reference=${REGISTRY}/*"
}

step_cluster() {
  need kind "bash scripts/e2e-kind.sh tools, or https://kind.sigs.k8s.io"
  if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
    log "cluster: kind cluster $CLUSTER exists"
  else
    log "cluster: kind create cluster $CLUSTER ($KIND_NODE_IMAGE)"
    kind create cluster --name "$CLUSTER" --image "$KIND_NODE_IMAGE" --wait 300s --kubeconfig "$KUBECONFIG"
  fi
  use_cluster
  kubectl get nodes -o wide
  kubectl get nodes -o custom-columns='NODE:.metadata.name,CPU:.status.allocatable.cpu,MEMORY:.status.allocatable.memory'
}

step_load() {
  log "load: $OPERATOR_IMAGE $RUNTIME_IMAGE -> kind $CLUSTER"
  local image
  for image in "$OPERATOR_IMAGE" "$RUNTIME_IMAGE"; do
    if ! kind load docker-image --name "$CLUSTER" "$image"; then
      # Docker's containerd image store (the default from Docker 29) can make this fail with
      # "content digest ... not found" (kind issue 3795); kind's documented way round: a
      # single-platform archive.
      echo "kind load docker-image $image failed: loading it as a $(platform) archive instead"
      docker image save --platform "$(platform)" -o "$WORK/image.tar" "$image"
      kind load image-archive --name "$CLUSTER" "$WORK/image.tar"
      rm -f "$WORK/image.tar"
    fi
  done
  for image in "$OPERATOR_IMAGE" "$RUNTIME_IMAGE"; do
    docker exec "${CLUSTER}-control-plane" crictl inspecti "$image" >/dev/null || die "$image is not on the kind node"
  done
  echo "on the node: $OPERATOR_IMAGE $RUNTIME_IMAGE"
  # The NATS image is pulled by the node from its registry: say now, not after a timeout, if it is not there.
  local nats
  nats="$(sed -n 's/^NATS_IMAGE = "\(.*\)".*/\1/p' operator/kuberl/operator/builders/bus.py)"
  docker buildx imagetools inspect "$nats" >/dev/null || die "the bus image $nats (operator/kuberl/operator/builders/bus.py NATS_IMAGE) cannot be found"
  echo "bus image $nats exists"
}

step_install() {
  need helm "bash scripts/e2e-kind.sh tools, or https://helm.sh"
  use_cluster
  log "install: helm chart charts/kuberl as $RELEASE in $OPERATOR_NAMESPACE"
  # The images were loaded into the node, not pushed: IfNotPresent (the chart's default, said
  # explicitly) uses them; runtime pods get IfNotPresent by default for a version tag.
  helm upgrade --install "$RELEASE" charts/kuberl --namespace "$OPERATOR_NAMESPACE" --create-namespace \
    --set image.repository="${REGISTRY}/operator" \
    --set image.tag="$VERSION" \
    --set image.pullPolicy=IfNotPresent \
    --set runtimeImages.repository="$REGISTRY" \
    --wait --timeout 5m
  kubectl -n "$OPERATOR_NAMESPACE" rollout status "deployment/$RELEASE" --timeout=300s
  kubectl wait --for=condition=Established crd/rlexperiments.kuberl.io --timeout=60s
  kubectl -n "$OPERATOR_NAMESPACE" get pods -o wide
}

step_test() {
  use_cluster
  log "test: python -m pytest e2e_tests against kind $CLUSTER (KUBECONFIG=$KUBECONFIG)"
  # tee-sys: the training test's progress lines show as they come, not only on failure.
  "$PY" -m pytest e2e_tests -v -ra -p no:cacheprovider --capture=tee-sys
}

# Prints the quickstart manifest to apply: examples/quickstart-cpu.yaml as it is when the node's free
# CPU and memory hold its requests, else with smaller requests (requests only reserve; the pods
# still use what the node has). A 4-core, 16 GB GitHub runner holds it as it is: it asks for 2.5 CPU
# and 5 GiB, kind's own pods and the operator for about 1.05 CPU.
quickstart_manifest() {
  local cluster_json
  cluster_json="$WORK/nodes-and-pods.json"
  kubectl get nodes,pods --all-namespaces -o json >"$cluster_json"
  "$PY" - "$QUICKSTART" "$cluster_json" <<'EOF'
import json
import sys

import yaml


def qty(v):
    v = str(v)
    for suffix, f in (("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30), ("Ti", 2**40), ("m", 1e-3), ("k", 1e3), ("M", 1e6), ("G", 1e9)):
        if v.endswith(suffix):
            return float(v[: -len(suffix)]) * f
    return float(v)


manifest, cluster = sys.argv[1], sys.argv[2]
items = json.load(open(cluster))["items"]
free = {"cpu": 0.0, "memory": 0.0}
for node in (i for i in items if i["kind"] == "Node"):
    for r in free:
        free[r] += qty(node["status"]["allocatable"][r])
for pod in (i for i in items if i["kind"] == "Pod" and i["status"].get("phase") not in ("Succeeded", "Failed")):
    for c in pod["spec"]["containers"]:
        for r in free:
            free[r] -= qty(((c.get("resources") or {}).get("requests") or {}).get(r, 0))
text = open(manifest).read()
doc = yaml.safe_load(text)
spec = doc["spec"]
want = {r: spec["rollout"].get("replicas", 1) * qty(spec["rollout"]["resources"]["requests"].get(r, 0))
        + qty(spec["trainer"]["resources"]["requests"].get(r, 0)) for r in free}
print(f"quickstart requests: {want['cpu']:.2f} CPU, {want['memory'] / 2**30:.1f} GiB; "
      f"free on the nodes: {free['cpu']:.2f} CPU, {free['memory'] / 2**30:.1f} GiB", file=sys.stderr)
if all(want[r] <= free[r] for r in free):
    print(text)
else:
    print("the quickstart does not fit: applying it with requests of 500m/2Gi (engine) and 250m/1Gi (trainer)", file=sys.stderr)
    spec["rollout"]["resources"] = {"requests": {"cpu": "500m", "memory": "2Gi"}}
    spec["trainer"]["resources"] = {"requests": {"cpu": "250m", "memory": "1Gi"}}
    print(yaml.safe_dump(doc, sort_keys=False))
EOF
}

step_quickstart() {
  local name manifest deadline next_report step phase
  name="$("$PY" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["metadata"]["name"])' "$QUICKSTART")"
  use_cluster
  log "quickstart: $QUICKSTART in namespace $QUICKSTART_NAMESPACE until progress.step >= $QUICKSTART_STEPS (at most ${QUICKSTART_TIMEOUT}s)"
  # The kuberl that `deps` installed into $PY, not whichever one PATH finds first (or none, and no check).
  "$PY" -m kuberl.cli validate "$QUICKSTART"
  manifest="$WORK/quickstart-cpu.yaml"
  quickstart_manifest >"$manifest"
  kubectl get namespace "$QUICKSTART_NAMESPACE" >/dev/null 2>&1 || kubectl create namespace "$QUICKSTART_NAMESPACE"
  kubectl -n "$QUICKSTART_NAMESPACE" apply -f "$manifest"
  deadline=$((SECONDS + QUICKSTART_TIMEOUT))
  next_report=0
  while :; do
    step="$(kubectl -n "$QUICKSTART_NAMESPACE" get rlx "$name" -o jsonpath='{.status.progress.step}' 2>/dev/null || true)"
    phase="$(kubectl -n "$QUICKSTART_NAMESPACE" get rlx "$name" -o jsonpath='{.status.phase}' 2>/dev/null || true)"
    if [ "$SECONDS" -ge "$next_report" ]; then
      echo "--- $(date -u +%H:%M:%S) phase=${phase:-?} step=${step:-0}"
      kubectl -n "$QUICKSTART_NAMESPACE" get rlx -o wide || true
      kubectl -n "$QUICKSTART_NAMESPACE" get pods -o wide || true
      next_report=$((SECONDS + 30))
    fi
    if [ "$phase" = Failed ]; then
      kubectl -n "$QUICKSTART_NAMESPACE" describe rlx "$name" || true
      die "the quickstart failed (phase Failed)"
    fi
    if [ "${step:-0}" -ge "$QUICKSTART_STEPS" ]; then
      kubectl -n "$QUICKSTART_NAMESPACE" get rlx "$name" -o wide
      echo "the quickstart trained ${step} steps on kind: OK (it keeps running; kubectl -n $QUICKSTART_NAMESPACE delete rlx $name stops it)"
      return 0
    fi
    [ "$SECONDS" -lt "$deadline" ] || die "progress.step of $name stayed below $QUICKSTART_STEPS for ${QUICKSTART_TIMEOUT}s"
    sleep 10
  done
}

# Everything needed to see why something failed; never fails itself.
step_dump() {
  set +e
  log "dump: kind cluster $CLUSTER"
  if ! kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then echo "no kind cluster $CLUSTER"; return 0; fi
  kind export kubeconfig --name "$CLUSTER" --kubeconfig "$KUBECONFIG" >/dev/null 2>&1
  kubectl get nodes -o wide
  kubectl describe nodes | sed -n '/^Allocated resources:/,/^Events:/p'
  kubectl get rlexperiments --all-namespaces -o wide
  local ns pod
  # local-path-storage: kind's volume provisioner (a Pending PVC shows why there).
  for ns in "$OPERATOR_NAMESPACE" "$E2E_NAMESPACE" "$QUICKSTART_NAMESPACE" local-path-storage; do
    kubectl get namespace "$ns" >/dev/null 2>&1 || continue
    [ -z "${GITHUB_ACTIONS:-}" ] || echo "::group::namespace $ns"
    echo "--- namespace $ns: objects"
    kubectl -n "$ns" get all,pvc,configmaps,rlexperiments -o wide
    echo "--- namespace $ns: experiments"
    kubectl -n "$ns" describe rlexperiments
    echo "--- namespace $ns: pods"
    kubectl -n "$ns" describe pods
    echo "--- namespace $ns: events"
    kubectl -n "$ns" get events --sort-by=.lastTimestamp
    for pod in $(kubectl -n "$ns" get pods -o name); do
      echo "--- namespace $ns: logs of $pod"
      kubectl -n "$ns" logs "$pod" --all-containers --prefix --timestamps --tail=300
      kubectl -n "$ns" logs "$pod" --all-containers --prefix --timestamps --tail=100 --previous 2>/dev/null
    done
    [ -z "${GITHUB_ACTIONS:-}" ] || echo "::endgroup::"
  done
  rm -rf "$WORK/logs"
  kind export logs "$WORK/logs" --name "$CLUSTER" >/dev/null && echo "kind logs (nodes, kubelet, containerd): $WORK/logs"
  return 0
}

step_down() {
  log "down: kind delete cluster $CLUSTER"
  kind delete cluster --name "$CLUSTER"
}

[ "$#" -gt 0 ] || { sed -n '2,22p' "$0"; exit 2; }
if [ "$1" = all ]; then set -- deps build cluster load install test quickstart; fi
for step in "$@"; do
  case "$step" in
    tools | deps | build | cluster | load | install | test | quickstart | dump | down) "step_$step" ;;
    *) die "unknown step $step (tools deps build cluster load install test quickstart dump down all)" ;;
  esac
done
