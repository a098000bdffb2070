"""Shared test configuration. A session that collects no test fails loudly instead of exiting 5."""

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    if not session.items and not session.config.getoption("collectonly"):
        raise pytest.UsageError("no tests were collected: check the paths and -k/-m filters")
