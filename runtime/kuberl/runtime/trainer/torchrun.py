"""`python -m kuberl.runtime.trainer.torchrun ARGS`: torchrun, passing a rank's configuration error on.

torchrun (torch.distributed.run) exits 1 whenever a worker fails, whatever the worker's own exit
code; the trainer pod would then never exit 2 and the Job's podFailurePolicy (FailJob on exit code 2,
docs/design/contracts.md) could not tell a configuration error from a crash. This runs torchrun's own
`main` unchanged (same arguments, same logs and error files) and only maps its ChildFailedError: exit 2
when the first failed rank exited 2 (kuberl.runtime.errors.CONFIG_ERROR_EXIT), else 1 as before.
The trainer Job and `kuberl run` (several trainer processes) start the trainer through this.
"""

from __future__ import annotations

import sys

from kuberl.runtime.errors import CONFIG_ERROR_EXIT
from kuberl.runtime.lifetime import watch_parent


def exit_code(failures: dict[int, object], first_rank: int) -> int:
    """The launcher's exit code for its failed ranks: 2 when the first to fail exited 2, else 1."""
    first = failures.get(first_rank)
    return CONFIG_ERROR_EXIT if getattr(first, "exitcode", None) == CONFIG_ERROR_EXIT else 1


def main(argv: list[str] | None = None) -> int:
    watch_parent()  # its ranks watch it in turn: none outlives it (kuberl.runtime.lifetime)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except ChildFailedError as exc:  # torchrun has printed its summary of the failed ranks
        rank, _ = exc.get_first_failure()
        return exit_code(exc.failures, rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
