"""The `kueue` pytest fixture (session scope): Kueue's real manager (kuberl.testing.kueue) on the session's local control
plane, started once after the operator (`kuberl_installed`), so the operator always starts without Kueue's CRDs and
picks up the Workload watch when they appear (tests/integration/test_operator_kueue_cache.py). Imported by the root
conftest.py; the tests that use it join the control plane's xdist group through `kuberl_installed`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def kueue(kuberl_installed: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if not kuberl_installed.local:
        pytest.skip("installs Kueue's CRDs, webhooks and manager: runs on the local control plane (KUBECONFIG unset)")
    from kuberl.testing.control_plane import SESSION_STOPS, STOPPED_EARLY
    from kuberl.testing.kueue import Kueue

    with Kueue(kuberl_installed.control_plane, tmp_path_factory.mktemp("kueue")) as kq:
        SESSION_STOPS.append(kq.stop)
        yield kq
        assert kq.alive or STOPPED_EARLY, f"Kueue's manager died during the tests:\n{kq.log_tail()}"
