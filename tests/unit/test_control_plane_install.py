"""scripts/install-control-plane.sh without building anything: the cache hit, the bin folder, a missing Go, and what a
build prints (a stand-in `go` that prints what Go prints on a cold cache)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install-control-plane.sh"
KUEUE_RECIPE = next(line.split("=")[1] for line in SCRIPT.read_text().splitlines() if line.startswith("KUEUE_RECIPE="))
BINS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "etcd", "kwok", "helm")


def run(*args: str, cache: Path, path: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["/bin/bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "KUBERL_CONTROL_PLANE_CACHE": str(cache), "PATH": path or os.environ["PATH"]})


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


FAKE_GO = r'''#!/usr/bin/env python3
"""A stand-in for the go command: says what Go says on a cold cache and makes the files a build would."""
import json, os, sys
from pathlib import Path
args, root = sys.argv[1:], Path(os.environ["FAKE_GO_ROOT"])
print(f"go: downloading example.com/{args[0]} v1.0.0", file=sys.stderr)
if args[0] == os.environ.get("FAKE_GO_FAIL"):
    print(f"go: {args[0]} broke: no space left on device", file=sys.stderr)
    sys.exit(1)
if args[:2] == ["mod", "download"]:
    (root / "go.mod").write_text("module m\nreplace k8s.io/api => ./staging/src/k8s.io/api\n")
    print(json.dumps({"GoMod": str(root / "go.mod")}))
elif args[0] == "list":
    (root / "kueue").mkdir(exist_ok=True)
    (root / "kueue" / "main.go").write_text('metricsCertPath := "/etc/kueue/metrics/certs"\n')
    print(root / "kueue")
elif args[0] == "build":
    out = args[args.index("-o") + 1]
    pkgs = [a for a in args[args.index("-o") + 2:]]
    for target in ([Path(out) / p.rsplit("/", 1)[-1] for p in pkgs] if out.endswith("/") else [Path(out)]):
        target.write_text("#!/bin/sh\n")
        target.chmod(0o755)
elif args[0] == "install":
    target = Path(os.environ["GOBIN"]) / args[-1].split("@")[0].rsplit("/", 1)[-1]
    target.write_text("#!/bin/sh\n")
    target.chmod(0o755)
'''


def fake_go(tmp_path: Path, monkeypatch) -> str:
    """The PATH for a run of the script whose `go` is FAKE_GO."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    (bin_dir / "go").write_text(FAKE_GO)
    (bin_dir / "go").chmod(0o755)
    (tmp_path / "goroot").mkdir()
    monkeypatch.setenv("FAKE_GO_ROOT", str(tmp_path / "goroot"))
    return f"{bin_dir}:/usr/bin:/bin"


def test_a_build_prints_one_line_per_stage_and_keeps_gos_output_in_its_log(tmp_path: Path, monkeypatch) -> None:
    out = run(cache=tmp_path / "cache", path=fake_go(tmp_path, monkeypatch))
    assert out.returncode == 0, out.stderr
    bin_dir = Path(out.stdout.strip())
    assert all((bin_dir / b).is_file() for b in (*BINS, "kueue-manager"))
    lines = out.stderr.splitlines()
    assert len(lines) == 5 and all(line.startswith("==> control plane: ") for line in lines), lines
    assert "go: downloading" in (tmp_path / "cache" / "build.log").read_text()


def test_a_failed_go_step_says_which_and_shows_the_end_of_its_output(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_GO_FAIL", "build")
    out = run(cache=tmp_path / "cache", path=fake_go(tmp_path, monkeypatch))
    assert out.returncode != 0
    assert "install-control-plane: 'go build" in out.stderr and "failed (exit 1)" in out.stderr
    assert "no space left on device" in out.stderr and str(tmp_path / "cache" / "build.log") in out.stderr


def test_a_failed_module_download_names_the_module_in_one_line_without_a_traceback(tmp_path: Path, monkeypatch) -> None:
    """`go mod download` fails (no network, a version the proxy refuses): once for Kubernetes, once for Kueue alone."""
    monkeypatch.setenv("FAKE_GO_FAIL", "mod")
    path = fake_go(tmp_path, monkeypatch)
    out = run(cache=tmp_path / "cache", path=path)
    log = tmp_path / "cache" / "build.log"
    assert out.returncode != 0 and out.stdout == ""
    assert not any(w in out.stderr for w in ("Traceback", "KeyError", "JSONDecodeError")), out.stderr
    lines = out.stderr.splitlines()
    assert lines[0].startswith("==> control plane: kube-apiserver"), lines
    assert lines[1] == f"install-control-plane: could not download k8s.io/kubernetes@v1.35.4 (the whole output in {log})"
    assert "go: mod broke: no space left on device" in lines[2:], lines  # the end of the log

    bin_dir = Path(run("--bin-dir", cache=tmp_path / "cache").stdout.strip())
    bin_dir.mkdir(parents=True, exist_ok=True)  # the failed run made it
    for name in BINS:
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    out = run(cache=tmp_path / "cache", path=path)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.splitlines()[:2] == [
        "==> control plane: kueue v0.17.0",
        f"install-control-plane: could not download sigs.k8s.io/kueue@v0.17.0 (the whole output in {log})"]
