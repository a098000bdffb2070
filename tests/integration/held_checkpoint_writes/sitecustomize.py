"""Test-only (put on PYTHONPATH by tests/integration/test_trainer.py): DCP's shard writes wait while the file named by
$KUBERL_TEST_HOLD_DCP_WRITES exists, as a multi-GB write on a slow volume would, so that a trainer can be killed with a
checkpoint still being written behind training. Nothing in the product reads this variable."""

import os

if os.environ.get("KUBERL_TEST_HOLD_DCP_WRITES"):
    import time

    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    _write_data = _FileSystemWriter.write_data

    def write_data(self, plan, planner):
        while os.path.exists(os.environ["KUBERL_TEST_HOLD_DCP_WRITES"]):
            time.sleep(0.1)
        return _write_data(self, plan, planner)

    _FileSystemWriter.write_data = write_data
