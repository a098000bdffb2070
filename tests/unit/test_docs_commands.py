"""Every shell command the front page and the guides show in a ```bash block works as written, as far as a test
without a cluster can tell: each command line is one of

- run by a test: RUN_BY names the file that runs it (and that file must name the script);
- checked: `kuberl ...` (also `python -m kuberl.cli ...`) parses with the real CLI's argparse, and every manifest it
  names exists and passes `kuberl validate`; `bash scripts/X.sh ARGS` and `python bench/X.py --FLAGS` name a file
  that exists and knows each argument and flag; `python -m pytest PATHS` names test paths that exist; `python -m M`
  names an importable module; `pip install` names kuberl extras that exist; `cp`, `cd`, `export` name what exists;
  `git clone URL` clones this project (the chart's `home`);
- marked with what it needs, as a comment on its line: `# needs a cluster`, `# needs a GPU`, `# needs Docker` or
  `# needs a cloud account` (the words may follow other text in the comment). A comment line alone with the marker
  marks every line below it in the same block. Marked lines are not run, but the checks above that need nothing
  (the CLI's parse, files and flags) still apply, the repository paths they name must exist, and a manifest they
  `kubectl apply -f` must pass `kuberl validate`.

A line continued with a trailing backslash is one command. Commands joined with `&&`, `;` or `|` are checked one by
one. docs/development.md describes the markers for writers.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from unittest.mock import ANY

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
# The front page and every user page: the guides, the cloud and cluster guides, benchmarks (docs/design/ holds design
# notes, not instructions).
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "guides").glob("*.md"))]
MARKER = re.compile(r"#.*\bneeds (a cluster|a GPU|Docker|a cloud account)\b")
RUN_BY = {  # command -> the file that runs it
    "bash scripts/test.sh": ".ci/run",
    "bash scripts/setup.sh": "tests/unit/test_setup_script.py",
    "bash scripts/quickstart.sh": "tests/unit/test_docs_commands.py",
}
REPO_PATH = re.compile(r"^(?:\./)?(examples|crds|charts|scripts|bench|tests|e2e_tests|docs|images)/[^\s'\"]*")


def commands(page: Path) -> list[tuple[int, str, bool]]:
    """(line number, command, marked) of every command line in the page's ```bash blocks."""
    out: list[tuple[int, str, bool]] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        if not re.match(r"^```(bash|sh|shell)\s*$", lines[i]):
            i += 1
            continue
        block_marked = False
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            start, line = i + 1, lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1].rstrip() + " " + lines[i].strip()
            stripped = line.strip()
            if stripped.startswith("#"):
                block_marked = block_marked or bool(MARKER.search(stripped))
            elif stripped:
                out.append((start, stripped, block_marked or bool(MARKER.search(stripped))))
            i += 1
        i += 1
    return out


def words(command: str) -> list[list[str]]:
    """The simple commands of a line (split at &&, ;, | and &), each as argv without leading VAR=value words."""
    tokens = shlex.split(command, comments=True)
    out, current = [], []
    for token in tokens + [";"]:
        if token in ("&&", ";", "|", "||", "&"):
            while current and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", current[0]):
                current.pop(0)
            if current:
                out.append(current)
            current = []
        else:
            current.append(token)
    return out


def manifest_errors(path: Path) -> list[str]:
    """`kuberl validate` of one manifest file: its errors, or that it is missing."""
    from kuberl.api.loading import load_documents
    from kuberl.api.validation import validate_manifest

    if not path.is_file():
        return [f"{path.relative_to(ROOT)} does not exist"]
    return [f"{path.relative_to(ROOT)}: {e}" for d in load_documents(str(path)) if d.get("kind") == "RLExperiment"
            for e in validate_manifest(d)]


def check_kuberl(argv: list[str]) -> list[str]:
    from kuberl.cli import build_parser

    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        return [f"`kuberl {' '.join(argv)}` does not parse with the kuberl CLI"]
    files = [getattr(args, "file", None), *(getattr(args, "files", None) or [])]
    return [e for f in files if f for e in manifest_errors(ROOT / f)]


def check_file_and_flags(path: str, args: list[str]) -> list[str]:
    """A script or benchmark that exists and names each argument and flag it is given."""
    target = ROOT / path
    if not target.is_file():
        return [f"{path} does not exist"]
    text = target.read_text()
    wanted = [a.split("=", 1)[0] for a in args if a.startswith("-") or re.fullmatch(r"[a-z][a-z-]*", a)]
    return [f"{path} knows no {a}" for a in wanted if a not in text]


def check_python(argv: list[str]) -> list[str]:
    if argv[:2] == ["-m", "pytest"]:
        paths = [a.split("::")[0] for a in argv[2:] if not a.startswith("-")]
        return [f"no test path {p}" for p in paths if not (ROOT / p).exists()]
    if argv[:2] == ["-m", "kuberl.cli"]:
        return check_kuberl(argv[2:])
    if argv[:1] == ["-m"]:
        return [] if importlib.util.find_spec(argv[1]) else [f"no module {argv[1]}"]
    return check_file_and_flags(argv[0], argv[1:])


def check_pip(argv: list[str]) -> list[str]:
    from packaging.requirements import Requirement

    projects = {}
    for pyproject in ("pyproject.toml", "operator/pyproject.toml", "runtime/pyproject.toml"):
        data = tomllib.loads((ROOT / pyproject).read_text())["project"]
        projects[data["name"]] = set(data.get("optional-dependencies", {}))
    problems = []
    for spec in (a for a in argv[1:] if not a.startswith("-")):
        req = Requirement(spec)
        if req.name in projects:
            problems += [f"{req.name} has no extra {e}" for e in req.extras if e not in projects[req.name]]
    return problems


def project_url() -> str:
    return yaml.safe_load((ROOT / "charts" / "kuberl" / "Chart.yaml").read_text())["home"].rstrip("/")


def check_simple(argv: list[str]) -> list[str] | None:
    """Problems with one simple command, or None when nothing here can check it (it must be marked)."""
    program, rest = argv[0], argv[1:]
    if program == "kuberl":
        return check_kuberl(rest)
    if program == "bash" and rest and rest[0].startswith("scripts/"):
        return check_file_and_flags(rest[0], rest[1:])
    if program in ("python", "python3") and rest:
        return check_python(rest)
    if program in ("pip", "pip3") and rest[:1] == ["install"]:
        return check_pip(rest)
    if program in ("cp", "cd"):
        return [f"{a} does not exist" for a in rest[:1] if not a.startswith("-") and not (ROOT / a).exists()]
    if program == "export":
        return []
    if program == "git" and rest[:1] == ["clone"]:
        urls = [a for a in rest[1:] if not a.startswith("-")][:1]
        return [f"{u} is not this project's repository ({project_url()})" for u in urls
                if u.removesuffix(".git").rstrip("/") != project_url()]
    return None


def check_line(command: str, marked: bool) -> list[str]:
    """What is wrong with one command line of a page."""
    problems = []
    for argv in words(command):
        for token in argv:
            m = REPO_PATH.match(token)
            if m and not any(c in m.group(0) for c in "*<$") and not (ROOT / m.group(0)).exists():
                problems.append(f"{m.group(0)} does not exist")
        if argv[:2] == ["kubectl", "apply"]:
            files = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-f", "--filename")]
            problems += [e for f in files if REPO_PATH.match(f) and f.endswith(".yaml") for e in manifest_errors(ROOT / f)]
        if marked:
            problems += check_simple(argv) or []  # what needs nothing (a parse, a file, a flag) is checked all the same
            continue
        key = " ".join(argv)
        if key in RUN_BY:
            runner = ROOT / RUN_BY[key]
            if argv[-1] not in runner.read_text():
                problems.append(f"{RUN_BY[key]} does not run {argv[-1]}")
            continue
        found = check_simple(argv)
        if found is None:
            problems.append(f"`{key}` is neither run by a test nor checked: mark what it needs (# needs a cluster, "
                            f"# needs a GPU, # needs Docker, # needs a cloud account)")
        else:
            problems += found
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_is_run_checked_or_marked(page: Path) -> None:
    found = commands(page)
    problems = [f"{page.relative_to(ROOT)}:{n}: {c}: {p}" for n, c, marked in found for p in check_line(c, marked)]
    assert problems == []


def test_the_front_page_shows_its_two_commands_and_they_are_run() -> None:
    shown = [c for _, c, _ in commands(ROOT / "README.md")]
    for command in ("bash scripts/quickstart.sh", "bash scripts/test.sh"):
        assert any(c.split("#")[0].strip() == command for c in shown), command
    assert "exec bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("line,expected", [
    ("kubectl get pods", "neither run by a test nor checked"),
    ("kuberl frobnicate x.yaml", "does not parse"),
    ("kuberl run examples/missing.yaml", "examples/missing.yaml does not exist"),
    ("python bench/bench_trl.py --no-such-flag", "knows no --no-such-flag"),
    ("bash scripts/e2e-kind.sh no-such-step", "knows no no-such-step"),
    ("python3 -m pytest tests/no_such_dir", "no test path"),
    ("pip install 'kuberl-runtime[nosuchextra]'", "has no extra nosuchextra"),
    ("kubectl apply -f examples/missing.yaml  # needs a cluster", "examples/missing.yaml does not exist"),
    ("kubectl apply -n rl -f examples/missing.yaml  # needs a cluster", "examples/missing.yaml does not exist"),
    ("kuberl plot x -n team-a --no-such-flag  # needs a cluster", "does not parse"),
    ("git clone https://github.com/someone/else && cd else", "not this project's repository"),
    ("gcloud container clusters create x", "neither run by a test nor checked"),
])
def test_the_checks_can_fail(line: str, expected: str) -> None:
    marked = bool(MARKER.search(line))
    assert any(expected in p for p in check_line(line, marked)), check_line(line, marked)


def test_markers_pass_what_cannot_be_checked_here(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("```bash\nkubectl get rlx -w   # needs a cluster: watch it\n# needs Docker\ndocker buildx bake \\\n"
                    "  --push operator\n```\n\n```bash\nkubectl get pods\ngcloud auth login   # needs a cloud account\n"
                    "git clone https://github.com/kuberl/kuberl.git\n```\n")
    assert [(c, m) for _, c, m in commands(page)] == [
        ("kubectl get rlx -w   # needs a cluster: watch it", True), ("docker buildx bake --push operator", True),
        ("kubectl get pods", False), ("gcloud auth login   # needs a cloud account", True),
        ("git clone https://github.com/kuberl/kuberl.git", False)]
    assert [check_line(c, m) for _, c, m in commands(page)] == [[], [], [ANY], [], []]


def test_quickstart_installs_then_runs_the_quickstart_manifest(tmp_path: Path) -> None:
    """scripts/quickstart.sh for real, under a PYTHON that records pip and `kuberl run` instead of running them:
    it prints one line per stage, no warning, and runs a manifest that passes `kuberl validate`."""
    log, site = tmp_path / "calls.log", tmp_path / "site-packages"
    site.mkdir()
    python = tmp_path / "python"
    python.write_text(f"""#!/usr/bin/env bash
if [ "$1" = -m ] && {{ [ "$2" = pip ] || [ "$3" = run ]; }}; then echo "$*" >> {log}; exit 0; fi
if [ "$1" = -c ] && [[ "$2" == *sysconfig* ]]; then echo {site}; exit 0; fi
exec {sys.executable} "$@"
""")
    python.chmod(0o755)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "quickstart.sh"), "--max-steps", "3"],
                         env={**os.environ, "PYTHON": str(python)}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert all(line.startswith("==> ") for line in lines), lines
    assert lines[-1] == "==> kuberl run examples/quickstart.yaml --max-steps 3 (Ctrl-C stops every role)"
    assert not re.search(r"error|warn", out.stdout + out.stderr, re.IGNORECASE)
    calls = log.read_text().splitlines()
    assert calls[-1] == "-m kuberl.cli run examples/quickstart.yaml --max-steps 3"
    assert manifest_errors(ROOT / "examples" / "quickstart.yaml") == []
    assert yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())["spec"]["rollout"]["engine"] == "vllm"
