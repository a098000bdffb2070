"""installed_executable: a program pip put next to this Python is found without that folder on PATH."""

from __future__ import annotations

import subprocess
import sys
import sysconfig

from kuberl.executables import installed_executable


def test_a_program_in_the_interpreters_scripts_folder_is_found_with_an_empty_path(monkeypatch, tmp_path):
    scripts = tmp_path / "venv-bin"
    scripts.mkdir()
    (scripts / "tool").write_text("#!/bin/sh\n")
    (scripts / "tool").chmod(0o755)
    (scripts / "not-executable").write_text("")
    real = sysconfig.get_path
    monkeypatch.setattr(sysconfig, "get_path", lambda name, *a: str(scripts) if name == "scripts" and not a else real(name, *a))
    monkeypatch.setenv("PATH", "")
    assert installed_executable("tool") == str(scripts / "tool")
    assert installed_executable("not-executable") is None


def test_path_is_the_last_place_looked(monkeypatch, tmp_path):
    (tmp_path / "elsewhere").write_text("#!/bin/sh\n")
    (tmp_path / "elsewhere").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert installed_executable("elsewhere") == str(tmp_path / "elsewhere")
    assert installed_executable("kuberl-no-such-program") is None


def test_the_test_extras_linters_are_found_by_a_python_called_by_path_without_its_folder_on_path():
    """What CI does with a virtualenv's python: `.../venv/bin/python -m pytest`, the venv not activated."""
    code = "from kuberl.executables import installed_executable as f; print([bool(f(n)) for n in ('hadolint', 'actionlint', 'shellcheck', 'nats-server')])"
    out = subprocess.run([sys.executable, "-c", code], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[True, True, True, True]", out.stderr
