#!/usr/bin/env bash
# Builds the real Kubernetes control plane the operator's tests run against, from the upstream Go modules:
# kube-apiserver, kube-controller-manager, kube-scheduler and kubectl (k8s.io/kubernetes), etcd (go.etcd.io/etcd),
# KWOK (sigs.k8s.io/kwok: fake nodes and pod lifecycles), helm (helm.sh/helm) and, asked for, Kueue's manager
# (sigs.k8s.io/kueue). Each is built once into a cache keyed by its version and reused (a re-run takes
# well under a second); the Go module and build caches are Go's own (go env GOMODCACHE GOCACHE).
#   bash scripts/install-control-plane.sh             # build what is missing, print the bin folder
#   bash scripts/install-control-plane.sh --bin-dir   # print the bin folder only
#   bash scripts/install-control-plane.sh --without-kueue  # all but Kueue's manager (the real-Kueue tests then fail)
# KUBERL_CONTROL_PLANE_CACHE moves the cache (default ~/.cache/kuberl/control-plane).
set -euo pipefail

K8S_VERSION=v1.35.4     # Kueue v0.17 is built against k8s.io v0.35; its go line (1.25) fits Go 1.26
ETCD_VERSION=v3.6.16
KWOK_VERSION=v0.8.0
HELM_VERSION=v3.22.0
KUEUE_VERSION=v0.17.0

RECIPE=2               # bump when the way the binaries are built changes (flags), so that cached ones are rebuilt
CACHE="${KUBERL_CONTROL_PLANE_CACHE:-$HOME/.cache/kuberl/control-plane}"
BIN="$CACHE/bin-k8s-$K8S_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION-helm-$HELM_VERSION-kueue-$KUEUE_VERSION-r$RECIPE"
if [ "${1:-}" = "--bin-dir" ]; then echo "$BIN"; exit 0; fi

K8S_BINS=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
ALL_BINS=("${K8S_BINS[@]}" etcd kwok helm)
if [ "${1:-}" != "--without-kueue" ]; then ALL_BINS+=(kueue-manager); fi
# Kueue's manager is rebuilt alone when its recipe (the overlay below) changes, Kubernetes is not.
KUEUE_RECIPE=1
if [ -x "$BIN/kueue-manager" ] && [ "$(cat "$BIN/kueue-manager.recipe" 2>/dev/null)" != "$KUEUE_RECIPE" ]; then rm -f "$BIN/kueue-manager"; fi
missing=()
for b in "${ALL_BINS[@]}"; do [ -x "$BIN/$b" ] || missing+=("$b"); done
if [ "${#missing[@]}" -eq 0 ]; then echo "$BIN"; exit 0; fi

if ! command -v go >/dev/null 2>&1; then
  echo "install-control-plane: Go >= 1.25 is needed to build the Kubernetes control plane; install it (https://go.dev/dl) and re-run" >&2
  exit 1
fi
mkdir -p "$BIN" "$CACHE/src"
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false
log() { echo "==> control plane: $*" >&2; }
# Go's own output (a 'go: downloading' line per module on a cold cache, some 130 in all) goes to $LOG: one line per
# stage is printed, and a failure prints the end of the log and where the rest is.
LOG="$CACHE/build.log"
: > "$LOG"
go() {
  local rc=0
  command go "$@" >>"$LOG" 2>&1 || rc=$?
  [ "$rc" -eq 0 ] && return 0
  { echo "install-control-plane: 'go $*' failed (exit $rc); the end of its output (all of it in $LOG):"
    tail -n 25 "$LOG"; } >&2
  return "$rc"
}
# $1: what could not be done, in one line; then the end of $LOG, and exit.
fail_with_log() { { echo "install-control-plane: $1 (the whole output in $LOG)"; tail -n 25 "$LOG"; } >&2; exit 1; }
# The go.mod file of module@version, downloaded into Go's module cache. A download that fails (no network, a version
# the proxy refuses) is said in one line with the end of $LOG (Go's -json answer, its Error, is written there).
mod_gomod() {
  local json gomod=""
  if json="$(command go mod download -json "$1" 2>>"$LOG")"; then
    gomod="$(printf '%s' "$json" | python3 -c 'import json, sys
try:
    print(json.load(sys.stdin).get("GoMod") or "")
except ValueError:
    pass' 2>>"$LOG")" || gomod=""
  fi
  if [ -z "$gomod" ] || [ ! -f "$gomod" ]; then
    printf '%s\n' "$json" >>"$LOG"
    fail_with_log "could not download $1"
  fi
  echo "$gomod"
}
build_flags=(-trimpath -ldflags=-s\ -w)

# A module of our own that requires the component, so that the component's go.mod replaces (which Go ignores
# in a dependency) can be restated here. $1: folder, $2: module@version, then replace pairs "old=new".
wrapper_module() {
  local dir="$1" req="$2"; shift 2
  rm -rf "$dir"; mkdir -p "$dir"
  ( cd "$dir"
    printf 'module kuberl.local/controlplane\n\ngo 1.25\n' > go.mod
    go mod edit -require="$req"
    for r in "$@"; do go mod edit -replace="$r"; done )
}

need() { for b in "$@"; do [[ " ${ALL_BINS[*]} " == *" $b "* && ! -x "$BIN/$b" ]] && return 0; done; return 1; }

if need "${K8S_BINS[@]}"; then
  log "kube-apiserver, kube-controller-manager, kube-scheduler, kubectl $K8S_VERSION (cold: see docs/benchmarks.md)"
  dir="$CACHE/src/kubernetes-$K8S_VERSION"
  staging="v0.${K8S_VERSION#v1.}"
  # k8s.io/kubernetes requires each staging module at v0.0.0 and replaces it with ./staging/src/...; map each one
  # to its published tag, the list read from that release's own go.mod (it changes between releases).
  gomod="$(mod_gomod "k8s.io/kubernetes@$K8S_VERSION")" || exit 1
  replaces=()
  while read -r m; do
    replaces+=("$m=$m@$staging")
  done < <(grep -oE 'k8s\.io/[a-z0-9-]+ => \./staging/' "$gomod" | awk '{print $1}' | sort -u)
  wrapper_module "$dir" "k8s.io/kubernetes@$K8S_VERSION" "${replaces[@]}"
  ( cd "$dir"
    cat > tools.go <<'EOF'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
EOF
    go mod tidy
    # The version the binaries report (kubectl version, /version; Helm's kubeVersion checks read it), as the
    # release build stamps it; without it they say v0.0.0-master.
    minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
    x=""
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
      x+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
      x+=" -X $pkg.buildDate=1970-01-01T00:00:00Z"
    done
    go build -trimpath "-ldflags=-s -w$x" -o "$BIN/" k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl )
fi

if need etcd; then
  log "etcd $ETCD_VERSION"
  dir="$CACHE/src/etcd-$ETCD_VERSION"
  wrapper_module "$dir" "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
  ( cd "$dir"
    printf '//go:build tools\n\npackage tools\n\nimport _ "go.etcd.io/etcd/server/v3"\n' > tools.go
    go mod tidy
    go build "${build_flags[@]}" -o "$BIN/etcd" go.etcd.io/etcd/server/v3 )
fi

if need kwok; then
  log "kwok $KWOK_VERSION"
  GOBIN="$BIN" go install "${build_flags[@]}" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
fi

if need helm; then
  log "helm $HELM_VERSION"
  GOBIN="$BIN" go install "${build_flags[@]}" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
fi

if need kueue-manager; then
  log "kueue $KUEUE_VERSION"
  dir="$CACHE/src/kueue-$KUEUE_VERSION"
  # Kueue's own replaces, restated (none today; read them so a release that adds one still builds).
  gomod="$(mod_gomod "sigs.k8s.io/kueue@$KUEUE_VERSION")" || exit 1
  mapfile -t replaces < <(python3 - "$gomod" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
block = re.findall(r"^replace\s*\((.*?)^\)", text, re.S | re.M)
lines = [l for b in block for l in b.splitlines()] + re.findall(r"^replace\s+([^(].*)$", text, re.M)
for l in lines:
    m = re.match(r"\s*(\S+)(?:\s+\S+)?\s*=>\s*(\S+)(?:\s+(\S+))?", l)
    if m and not m.group(2).startswith("."):
        print(f"{m.group(1)}={m.group(2)}" + (f"@{m.group(3)}" if m.group(3) else ""))
EOF
  )
  wrapper_module "$dir" "sigs.k8s.io/kueue@$KUEUE_VERSION" "${replaces[@]}"
  ( cd "$dir"
    printf '//go:build tools\n\npackage tools\n\nimport _ "sigs.k8s.io/kueue/cmd/kueue"\n' > tools.go
    go mod tidy
    # Kueue's cmd/kueue/main.go, built as a package of this module with one change (the module source is untouched):
    # with its internal cert management off, Kueue reads the metrics server's certificate from
    # /etc/kueue/metrics/certs, which a test cannot write; $KUEUE_METRICS_CERT_DIR names another folder
    # (kuberl/testing/kueue.py). Every other line and package is Kueue's own.
    main="$(command go list -f '{{.Dir}}' sigs.k8s.io/kueue/cmd/kueue 2>>"$LOG")/main.go" \
      || fail_with_log "could not find sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION in Go's module cache"
    mkdir -p kueue
    python3 -c '
import sys
src, dst = sys.argv[1], sys.argv[2]
old = "metricsCertPath := \"/etc/kueue/metrics/certs\""
text = open(src).read()
if old not in text:
    sys.exit(f"install-control-plane: {src} no longer has {old}: update the Kueue build")
new = old + "\n\t\tif d := os.Getenv(\"KUEUE_METRICS_CERT_DIR\"); d != \"\" {\n\t\t\tmetricsCertPath = d\n\t\t}"
open(dst, "w").write(text.replace(old, new))
' "$main" kueue/main.go
    go build "${build_flags[@]}" -o "$BIN/kueue-manager" ./kueue
    echo "$KUEUE_RECIPE" > "$BIN/kueue-manager.recipe" )
fi

for b in "${ALL_BINS[@]}"; do [ -x "$BIN/$b" ] || { echo "install-control-plane: $b was not built" >&2; exit 1; }; done
echo "$BIN"
