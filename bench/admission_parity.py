"""Admission parity, fuzzed (issue #36): N generated RLExperiment manifests through a real API server and `kuberl validate`.

    python bench/admission_parity.py                 # 10,000 manifests on a control plane of its own (etcd + kube-apiserver...)
    python bench/admission_parity.py -n 2000 --seed 7
    KUBECONFIG=~/.kube/config python bench/admission_parity.py --use-kubeconfig   # an existing cluster (CRD applied there)

Starts kuberl.testing.control_plane.ControlPlane(nodes=False) (binaries from scripts/install-control-plane.sh), or
with --use-kubeconfig talks to $KUBECONFIG's current context. Server-side applies the CRD that `kuberl crd` generates
(the same as crds/; with --crd-dir, the files there instead) and waits until it is Established. Each manifest of
kuberl.testing.admission_fuzz.generate(N, seed) is a dry-run create with fieldValidation=Strict (nothing is stored)
and goes through kuberl.api.validation.check_admission; the two must admit and reject the same ones. Prints the
counts, the admitted-by-both manifests the pydantic models reject grouped by message, how often the error paths
agree, and the time. Disagreements (and requests that were neither admitted nor rejected) go to --out as JSON lines.
Exits 1 on any disagreement or server error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kuberl.testing.admission_fuzz import generate  # noqa: E402
from kuberl.testing.admission_parity import ApiServer, run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=10_000, help="manifests (default 10000)")
    p.add_argument("--seed", type=int, default=36, help="generator seed (default 36)")
    p.add_argument("--workers", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument("--out", default="admission-parity-disagreements.jsonl", help="where the disagreements go (JSON lines)")
    p.add_argument("--examples", type=int, default=20, help="disagreements written to --out (default 20)")
    p.add_argument("--crd-dir", type=Path, default=None, help="apply the CRD from this folder (e.g. crds/) instead of `kuberl crd`'s")
    p.add_argument("--use-kubeconfig", action="store_true", help="use $KUBECONFIG's cluster instead of starting a control plane")
    args = p.parse_args(argv)

    crd = None
    if args.crd_dir:
        crd = next(d for f in sorted(args.crd_dir.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())
                   if d and d.get("kind") == "CustomResourceDefinition")
    started = time.monotonic()
    if args.use_kubeconfig:
        api = ApiServer.from_kubeconfig(os.environ.get("KUBECONFIG") or Path.home() / ".kube" / "config")
        return parity(api, crd, args, started)
    from kuberl.testing.control_plane import ControlPlane

    with tempfile.TemporaryDirectory(prefix="kuberl-admission-parity-") as tmp, ControlPlane(tmp, nodes=False) as cp:
        print(f"control plane up in {time.monotonic() - started:.1f} s ({cp.server})", flush=True)
        return parity(ApiServer.from_control_plane(cp), crd, args, started)


def parity(api: ApiServer, crd: dict | None, args: argparse.Namespace, started: float) -> int:
    t = time.monotonic()
    api.install_crd(crd)
    print(f"CRD Established and serving in {time.monotonic() - t:.1f} s", flush=True)
    report = run(api, generate(args.n, args.seed), workers=args.workers)
    print(report.text())
    bad = report.disagreements + report.server_errors
    if bad:
        with open(args.out, "w") as f:
            for record in bad[: args.examples]:
                f.write(json.dumps(record, default=str) + "\n")
        print(f"first {min(len(bad), args.examples)} of {len(bad)} disagreements and server errors written to {args.out}")
    print(f"total {time.monotonic() - started:.1f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
