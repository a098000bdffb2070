"""scripts/install-control-plane.sh without building anything: the cache hit, the bin folder, and a missing Go."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install-control-plane.sh"
KUEUE_RECIPE = next(line.split("=")[1] for line in SCRIPT.read_text().splitlines() if line.startswith("KUEUE_RECIPE="))
BINS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "etcd", "kwok", "helm")


def run(*args: str, cache: Path, path: str = os.environ.get("PATH", "")) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["/bin/bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "KUBERL_CONTROL_PLANE_CACHE": str(cache), "PATH": path})


def test_the_cache_is_keyed_by_every_version_and_a_full_one_is_used_as_it_is(tmp_path: Path) -> None:
    bin_dir = Path(run("--bin-dir", cache=tmp_path).stdout.strip())
    assert bin_dir.parent == tmp_path and "k8s-v1.35" in bin_dir.name and "etcd-v3.6" in bin_dir.name
    bin_dir.mkdir(parents=True)
    for name in (*BINS, "kueue-manager"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    (bin_dir / "kueue-manager.recipe").write_text(KUEUE_RECIPE + "\n")
    out = run(cache=tmp_path, path="/usr/bin:/bin")  # no Go needed when nothing is missing
    assert out.returncode == 0 and out.stdout.strip() == str(bin_dir) and out.stderr == ""


def test_without_go_it_says_in_one_line_what_to_install(tmp_path: Path) -> None:
    out = run(cache=tmp_path, path="/usr/bin:/bin")  # bash and coreutils, no go
    assert out.returncode == 1
    assert out.stderr.strip().count("\n") == 0 and "Go >= 1.25" in out.stderr and "install it" in out.stderr


def test_kueue_is_built_by_default_and_left_out_when_asked(tmp_path: Path) -> None:
    bin_dir = Path(run("--bin-dir", cache=tmp_path).stdout.strip())
    bin_dir.mkdir(parents=True)
    for name in BINS:
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    assert run("--without-kueue", cache=tmp_path, path="/usr/bin:/bin").returncode == 0
    assert run(cache=tmp_path, path="/usr/bin:/bin").returncode == 1, "kueue-manager is missing: it would build"
    (bin_dir / "kueue-manager").write_text("#!/bin/sh\n")
    (bin_dir / "kueue-manager").chmod(0o755)
    assert run(cache=tmp_path, path="/usr/bin:/bin").returncode == 1, "no recipe stamp: an older kueue-manager is rebuilt"
    assert not (bin_dir / "kueue-manager").exists()
