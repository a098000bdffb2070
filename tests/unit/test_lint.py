"""Code health: `ruff check .` with the committed [tool.ruff] configuration (pyproject.toml) finds nothing.

Runs ruff as CI does, from the repository root. ruff comes with kuberl[test] (pinned there); a missing
install fails here, it is not skipped.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=120)


def test_the_tree_is_clean_under_the_committed_ruff_configuration():
    out = ruff("check", ".", "--output-format", "concise", "--no-cache")
    assert out.returncode == 0, f"ruff check . found problems (fix them, or `ruff check --fix .`):\n{out.stdout}{out.stderr}"


def test_the_installed_ruff_is_the_pinned_one():
    # Another ruff version brings other rules and fixes: the tree is clean under the pinned one.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    pins = [re.fullmatch(r"ruff==([\w.]+)", e) for e in extras]
    pinned = [m.group(1) for m in pins if m]
    assert len(pinned) == 1, f"kuberl[test] must pin ruff exactly (ruff==X.Y.Z): {extras}"
    out = ruff("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ruff", pinned[0]], f"installed {out.stdout.strip()!r}, kuberl[test] pins {pinned[0]}: run scripts/setup.sh"


def test_the_configuration_sorts_kuberl_imports_as_first_party():
    # Guards the configuration itself: kuberl after the third-party block, a blank line between them.
    bad = "import os\n\nimport kuberl\nimport yaml\n\nprint(os, kuberl, yaml)\n"
    out = ruff("check", "--no-cache", "--stdin-filename", "kuberl/_lint_probe.py", "-", stdin=bad)
    assert out.returncode == 1 and "I001" in out.stdout, out.stdout + out.stderr
    good = "import os\n\nimport yaml\n\nimport kuberl\n\nprint(os, kuberl, yaml)\n"
    out = ruff("check", "--no-cache", "--stdin-filename", "kuberl/_lint_probe.py", "-", stdin=good)
    assert out.returncode == 0, out.stdout + out.stderr
