"""The session fixture `skypilot_python`: the Python of a venv holding the real SkyPilot (PyPI skypilot==0.14.1).

SkyPilot cannot share the test environment: it pins click<8.2 and uvicorn<0.36, which vLLM and typer
outgrow. So it lives in its own venv under `${XDG_CACHE_HOME:-~/.cache}/kuberl-test/skypilot-0.14.1`,
created on first use (about a minute, pip's progress shown on the terminal) and reused afterwards
(a finished venv carries a `.complete` stamp; one without it is a broken install and is rebuilt).
`KUBERL_SKYPILOT_VENV` overrides the folder. Imported by tests/integration/test_skypilot.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SKYPILOT_VERSION = "0.14.1"
log = logging.getLogger("kuberl.tests.skypilot")


def venv_dir() -> Path:
    override = os.environ.get("KUBERL_SKYPILOT_VENV")
    if override:
        return Path(override)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kuberl-test" / f"skypilot-{SKYPILOT_VERSION}"


@contextlib.contextmanager
def _terminal(config: pytest.Config) -> Iterator[None]:
    """Output capturing off, so pip's progress reaches the terminal while it runs."""
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is None:
        yield
        return
    with capman.global_and_fixture_disabled():
        yield


def _run_shown(cmd: list[str], config: pytest.Config, cwd: Path) -> None:
    """Run `cmd`, echoing each line of its output to the terminal and the log; fail on non-zero exit."""
    tail: list[str] = []
    with _terminal(config):
        print(f"\n[skypilot-venv] $ {' '.join(cmd)}", file=sys.stderr, flush=True)
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            tail = (tail + [line])[-40:]
            log.info("%s", line)
            print(f"[skypilot-venv] {line}", file=sys.stderr, flush=True)
        rc = proc.wait()
    if rc != 0:
        pytest.fail(f"{' '.join(cmd)} exited {rc}:\n" + "\n".join(tail), pytrace=False)


def _works(python: Path) -> bool:
    if not python.exists():
        return False
    with tempfile.TemporaryDirectory(prefix="sky-home-") as home:
        probe = subprocess.run([str(python), "-I", "-c", "import sys; from importlib.metadata import version; "
                                "sys.stdout.write(version('skypilot'))"],
                               cwd=home, capture_output=True, text=True, timeout=120, env=sky_env(Path(home)))
    return probe.returncode == 0 and probe.stdout.strip() == SKYPILOT_VERSION


def sky_env(home: Path) -> dict[str, str]:
    """Environment for SkyPilot processes: no credentials, no config, no usage reporting.
    HOME points at an empty folder, so ~/.aws, ~/.kube, ~/.sky and the like are not found."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "GOOGLE_", "AZURE_", "KUBECONFIG", "SKYPILOT_", "VIRTUAL_ENV", "PYTHON"))}
    env.update({"HOME": str(home), "SKYPILOT_DISABLE_USAGE_COLLECTION": "1", "SKYPILOT_DEBUG": "0",
                "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    return env


def ensure_venv(config: pytest.Config) -> tuple[Path, float, bool]:
    """(python of the venv, seconds spent, whether it was created now)."""
    start = time.monotonic()
    root = venv_dir()
    python = root / "bin" / "python"
    stamp = root / ".complete"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second session waits for the first one's install
        if stamp.exists() and _works(python):
            return python, time.monotonic() - start, False
        if root.exists():
            log.warning("rebuilding %s: no .complete stamp, or skypilot %s is not installed there", root, SKYPILOT_VERSION)
            shutil.rmtree(root)
        # -I and a neutral cwd: SkyPilot's venv must not see the repository or the user's site-packages.
        _run_shown([sys.executable, "-I", "-m", "venv", str(root)], config, cwd=root.parent)
        _run_shown([str(python), "-I", "-m", "pip", "install", "--progress-bar", "on", "--disable-pip-version-check",
                    f"skypilot=={SKYPILOT_VERSION}"], config, cwd=root.parent)
        if not _works(python):
            pytest.fail(f"{root}: pip succeeded, but skypilot {SKYPILOT_VERSION} is not there", pytrace=False)
        stamp.write_text(f"skypilot=={SKYPILOT_VERSION}\n")
        return python, time.monotonic() - start, True


@pytest.fixture(scope="session")
def skypilot_python(request: pytest.FixtureRequest) -> Path:
    """The Python executable of the venv with skypilot==0.14.1 (created once, then reused)."""
    python, seconds, created = ensure_venv(request.config)
    with _terminal(request.config):
        print(f"\n[skypilot-venv] {'created' if created else 'reused'} {python.parent.parent} in {seconds:.1f} s",
              file=sys.stderr, flush=True)
    return python
