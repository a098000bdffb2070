"""kuberl.runtime.trainer: the trainer role (`kuberl trainer`, one process per torchrun rank).

`Trainer` (trainer.py) runs the loop; `checkpoint.py` and `weights.py` are its file formats. Imported
lazily so `from kuberl.runtime.trainer import checkpoint` does not pull in the whole loop.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Trainer"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from kuberl.runtime.trainer.trainer import Trainer

        return Trainer
    raise AttributeError(name)
