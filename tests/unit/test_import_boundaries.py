"""The module boundaries of STYLE.md, checked on the source: kuberl.api imports neither torch nor kopf,
and kuberl.operator and kuberl.runtime never import each other (they meet only in the contracts).

An AST walk over the folders (no import-linter config to keep in sync): it reads every import
statement itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(folder: Path) -> dict[str, set[str]]:
    """file -> every module an import statement in it names (absolute imports only)."""
    found: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
        found[str(path.relative_to(folder.parent))] = names
    return found


def offenders(folder: Path, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{file} imports {name}"
        for file, names in imported_modules(folder).items()
        for name in names
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    )


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        ("operator/kuberl/operator", ("kuberl.runtime", "torch", "transformers")),
        ("runtime/kuberl/runtime", ("kuberl.operator", "kopf")),
        ("kuberl/api", ("torch", "kopf", "kuberl.operator", "kuberl.runtime")),
    ],
    ids=["the operator never imports the runtime or torch", "the runtime never imports the operator or kopf",
         "the API models import neither torch nor kopf nor a role"],
)
def test_module_boundaries_hold(folder, forbidden):
    assert offenders(ROOT / folder, forbidden) == []


def test_the_checker_sees_a_forbidden_import(tmp_path):
    (tmp_path / "operator").mkdir()
    (tmp_path / "operator" / "probe.py").write_text("import os\nfrom kuberl.runtime.bus import Bus\n")
    assert offenders(tmp_path / "operator", ("kuberl.runtime",)) == ["operator/probe.py imports kuberl.runtime.bus"]
