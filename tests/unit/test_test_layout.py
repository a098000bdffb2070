"""Test modules have unique basenames across tests/ and e2e_tests/: pytest imports them by basename (rootdir
conftest, no packages), so two `test_x.py` in different tiers pass when each tier runs alone and stop the
whole suite at collection ("import file mismatch") when CI runs every tier together."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_two_test_modules_share_a_basename() -> None:
    seen: dict[str, list[str]] = defaultdict(list)
    for folder in ("tests", "e2e_tests"):
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" not in path.parts:
                seen[path.name].append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1 and name != "__init__.py" and name != "conftest.py"}
    assert not shared, f"rename one of each: {shared}"
