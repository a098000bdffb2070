"""Shared test configuration. A session that collects no test fails loudly instead of exiting 5.

Under pytest-xdist (`scripts/test.sh` runs the suite as `-n 2 --dist loadgroup`), each test gets an
`xdist_group`: every test file that starts a vLLM engine or a whole `kuberl run` joins one group, run
by one worker one after another as it would be alone (two engines at once on 2 cores would make each
run's timing twice as slow); every other file is a group of its own (its module fixtures start once),
run by the other worker meanwhile: the unit tier, the bus, the trainer-only runs. Every test that talks to
Kubernetes (the root conftest.py's `kube` fixtures: e2e_tests and the operator's integration tests) joins the
group KUBE, so that one worker starts the control plane and the operator once.
"""

from pathlib import Path

import pytest

ENGINES = "engines"
KUBE = "kube"
# The root conftest.py's fixtures that start the control plane (and the chart and the operator on it).
KUBE_FIXTURES = frozenset({"kube", "kuberl_installed"})  # `fixturenames` is the closure: any user of these
# tests/integration files that start vLLM CPU engines or `kuberl run`s (conftest_engines' session server
# included), or that time roles against each other.
ENGINE_FILES = frozenset({
    "test_agent.py", "test_agent_run.py", "test_agent_tickets.py", "test_bus_users.py", "test_engine_auth_vllm.py",
    "test_evaluation_run.py", "test_external_agent_run.py", "test_faults.py", "test_framework_agents_run.py", "test_kuberl_run_backends.py",
    "test_launcher_progress.py",
    "test_lora_run.py", "test_lora_vllm.py", "test_metrics_stream.py", "test_ray_launcher.py", "test_rollout.py",
    "test_run.py", "test_run_lifetime.py", "test_sandbox_run.py", "test_trainer.py", "test_vllm.py", "test_vllm_parity.py", "test_weight_broadcast.py",
})


# The session fixtures that start a vLLM server (tests/integration/conftest_engines.py): a file using them must be
# in ENGINE_FILES (checked at collection), or the other worker would run its engine next to the engine group's.
ENGINE_FIXTURES = frozenset({"vllm_server", "vllm_instruct_server"})
# A test file that starts `kuberl run` as a subprocess (its engine, trainer and agent) has this in its source: it too
# must be in ENGINE_FILES (checked at collection, for the files of tests/integration).
KUBERL_RUN_CALL = '"kuberl.cli", "run"'


def starts_kuberl_runs(path: Path) -> bool:
    return path.suffix == ".py" and KUBERL_RUN_CALL in path.read_text(encoding="utf-8")


def xdist_group(nodeid: str, fixtures: frozenset[str] | set[str] = frozenset()) -> str:
    """The worker group of a test: ENGINES for the engine files of tests/integration, KUBE for the tests that use
    the control plane (e2e_tests, and any test with one of KUBE_FIXTURES), else its file."""
    if _in_engine_files(nodeid):
        return ENGINES
    path = Path(nodeid.split("::")[0])
    if path.parts[:1] == ("e2e_tests",) or KUBE_FIXTURES & set(fixtures):
        return KUBE
    return path.as_posix()


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns the marker into the group (and is registered later)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    strays = sorted({item.nodeid.split("::")[0] for item in items
                     if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())) and not _in_engine_files(item.nodeid)})
    if strays:
        raise pytest.UsageError(f"{', '.join(strays)}: start vLLM engines (fixtures {', '.join(sorted(ENGINE_FIXTURES))}) but are not "
                                "in ENGINE_FILES (tests/conftest.py); add them there, so that one worker runs every engine file")
    runs = sorted({str(item.path) for item in items if item.path.parent.name == "integration"
                   and item.path.name not in ENGINE_FILES and starts_kuberl_runs(item.path)})
    if runs:
        raise pytest.UsageError(f"{', '.join(runs)}: start `kuberl run` ({KUBERL_RUN_CALL}) but are not in ENGINE_FILES "
                                "(tests/conftest.py); add them there, so that one worker runs every engine file")
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group(item.nodeid, set(getattr(item, "fixturenames", ())))))


def _in_engine_files(nodeid: str) -> bool:
    path = Path(nodeid.split("::")[0])
    return path.parent.name == "integration" and path.name in ENGINE_FILES


def pytest_collection_finish(session: pytest.Session) -> None:
    if not session.items and not session.config.getoption("collectonly"):
        raise pytest.UsageError("no tests were collected: check the paths and -k/-m filters")
    # An xdist worker of `--dist loadgroup` sends each test's id with its group after an "@": without it the
    # engine files would be dealt to both workers (two engines at once). pytest 9.2 ignores how xdist 3.8 sets it.
    if getattr(session.config.option, "loadgroup", False) and (lost := [i.nodeid for i in session.items if "@" not in i.nodeid]):
        raise pytest.UsageError(f"pytest-xdist's loadgroup left {len(lost)} tests ungrouped (e.g. {lost[0]}): pytest "
                                f"{pytest.__version__} with this pytest-xdist does not group tests; install pytest<9.2 (pyproject.toml)")


class WorkerClock:
    """Under xdist, where each worker's time went: its busy seconds per group and when it reported its last test.
    The suite's wall time is the later worker's finish, so the summary shows whether a slow run was too much work
    or work dealt unevenly (the engine group is one unit of about 34 of the suite's 45 minutes)."""

    def __init__(self) -> None:
        import time

        self.t0 = time.monotonic()
        self.busy: dict[str, dict[str, float]] = {}
        self.last: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        import time

        worker = getattr(getattr(report, "node", None), "gateway", None)
        if worker is None:
            return
        group = report.nodeid.rpartition("@")[2] or "?"
        if "]" in group:  # an "@" inside a parameter id, not loadgroup's suffix (a run without --dist loadgroup)
            group = report.nodeid
        if group.startswith("tests/unit/"):
            group = "unit"
        per = self.busy.setdefault(worker.id, {})
        per[group] = per.get(group, 0.0) + report.duration
        self.last[worker.id] = time.monotonic() - self.t0

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.busy:
            return
        terminalreporter.section("time per xdist worker")
        for worker, per in sorted(self.busy.items()):
            top = sorted(per.items(), key=lambda kv: -kv[1])[:4]
            groups = ", ".join(f"{g} {s / 60:.1f}" for g, s in top)
            terminalreporter.write_line(f"{worker}: busy {sum(per.values()) / 60:.1f} min, last test at "
                                        f"{self.last[worker] / 60:.1f} min ({groups}, min)")


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        config.pluginmanager.register(WorkerClock(), "kuberl-worker-clock")
