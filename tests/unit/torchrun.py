"""`torchrun(script, *args)`: a test's worker script on several CPU processes under torchrun (gloo), the way the tests of
2-rank FSDP, context parallel, sharded weights and gradient sync run theirs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def torchrun(script: Path, *args: object, ranks: int = 2, timeout: float = 300, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run `script` with `args` on `ranks` processes (torch.distributed.run --standalone), output captured; the test
    fails with the tail of both streams when it does not exit 0."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(script),
                           *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc
