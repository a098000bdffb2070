"""scripts/mutation-check.py's table stays in step with the code: every mutant's old text is in its file exactly
once (a refactor that moves it fails here, in seconds, not only in the mutation tier), and a vanished text
is reported by name instead of the mutant silently disappearing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "mutation-check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("mutation_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_every_mutant_names_text_found_once_in_its_file_and_existing_tests():
    mc = load_script()
    assert mc.check_mutants(ROOT, mc.MUTANTS) == []
    assert len({m.id for m in mc.MUTANTS}) == len(mc.MUTANTS)
    assert all(m.old != m.new and m.tests for m in mc.MUTANTS)


def test_the_mutants_the_issue_lists_are_all_in_the_table():
    ids = {m.id for m in load_script().MUTANTS}
    assert {"weight-dropped", "weight-inverted", "ratio-vs-behave", "clip-removed", "baseline-removed",
            "trainer-temperature-ignored", "loss-gets-behave-as-prox", "stale-filter-removed",
            "capacity-one-batch-more", "weight-cap-boundary"} <= ids


def test_every_area_issue_37_left_unguarded_has_a_mutant():
    """Advantage variants, the agent proxy, token versions, weight sync, the KL term, the micro-batch and rank
    denominators, dropout detection (issue #37, point 8): each has at least one mutant in its file."""
    files = {m.file.removeprefix("runtime/kuberl/runtime/") for m in load_script().MUTANTS}
    ids = {m.id for m in load_script().MUTANTS}
    assert {"algorithms/advantages.py", "algorithms/losses.py", "rollout/openai_proxy.py", "rollout/workflows.py",
            "rollout/agent_workflow.py", "weight_sync/sender.py", "trainer/compute.py"} <= files
    assert {"rloo-mean-over-n", "batch-std-per-group", "drgrpo-normaliser-longest-answer", "gspo-ratio-summed", "kl-no-gradient",
            "kl-against-prox", "micro-batch-own-denominator", "dp-gradient-left-averaged", "dropout-top-level-only",
            "proxy-temperature-from-agent", "proxy-closing-duplicated", "proxy-budget-charged-on-return",
            "piece-version-for-every-token", "broadcast-one-rank-per-engine"} <= ids


def test_a_mutant_whose_text_is_gone_is_reported_by_name(tmp_path):
    mc = load_script()
    (tmp_path / "kuberl").mkdir()
    (tmp_path / "kuberl" / "x.py").write_text("a = 1\na = 1\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("")
    gone = mc.Mutant("gone", "", "kuberl/x.py", "b = 2", "b = 3", ("tests/test_x.py",))
    twice = mc.Mutant("twice", "", "kuberl/x.py", "a = 1", "a = 2", ("tests/test_nope.py::TestX",))
    problems = mc.check_mutants(tmp_path, (gone, twice))
    assert problems[0].startswith("gone: kuberl/x.py contains the old text 0 times")
    assert problems[1].startswith("twice: kuberl/x.py contains the old text 2 times")
    assert problems[2] == "twice: test file tests/test_nope.py does not exist"


def test_list_prints_every_mutant_without_running_tests():
    out = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, check=True).stdout
    assert out.count("\n    tests: ") == len(load_script().MUTANTS)


def test_the_mutation_tier_skips_its_baseline_only_when_the_session_runs_every_selected_test_itself() -> None:
    from tests.mutation.test_mutants import run_here

    collected = ["tests/unit/a.py::TestX::test_one", "tests/unit/a.py::test_two[p]", "tests/unit/b.py::test_three"]
    assert run_here(("tests/unit/a.py::TestX", "tests/unit/a.py::test_two", "tests/unit/b.py::test_three"), collected)
    assert not run_here(("tests/unit/a.py::TestX", "tests/unit/c.py::test_four"), collected)  # c.py is not in this session
    assert not run_here(("tests/unit/a.py::TestXY",), collected)  # a prefix of a name is not the test


def _tiny_copy(tmp_path: Path, body: str) -> Path:
    """A folder shaped like the mutation copy: tests/ with one test file that imports a module of the copy."""
    copy = tmp_path / "copy"
    (copy / "tests").mkdir(parents=True)
    (copy / "tests" / "__init__.py").write_text("")
    (copy / "tests" / "subject.py").write_text("VALUE = 1\n")
    (copy / "tests" / "test_subject.py").write_text(body)
    return copy


def test_the_fork_server_runs_each_request_on_the_files_as_they_are_then_and_kills_a_test_past_its_timeout(tmp_path, monkeypatch):
    """scripts/mutation_zygote.py: a forked child imports the copy's files afresh (a mutant written between two runs is
    seen), pytest's exit code comes back (1 failed, 0 passed), and a hanging test is killed at the timeout (-1)."""
    mc = load_script()
    monkeypatch.setenv("MUTATION_ZYGOTE_PRELOAD", "pytest,json")
    copy = _tiny_copy(tmp_path, "import time\nfrom tests import subject\n\ndef test_value():\n    assert subject.VALUE == 1\n\n"
                                "def test_hang():\n    if subject.VALUE == 3:\n        time.sleep(60)\n")
    z = mc.Zygote(copy)
    try:
        assert z.run_tests(("tests/test_subject.py",), 60)[0] == 0
        (copy / "tests" / "subject.py").write_text("VALUE = 2\n")  # a mutant, planted after the server started
        code, out = z.run_tests(("tests/test_subject.py::test_value",), 60)
        assert code == 1 and "assert 2 == 1" in out, out[-1000:]
        (copy / "tests" / "subject.py").write_text("VALUE = 3\n")
        t0 = time.monotonic()
        code, out = z.run_tests(("tests/test_subject.py::test_hang",), 3)
        assert code == -1 and "timed out after 3 s" in out
        assert time.monotonic() - t0 < 30, "the hanging test was waited for, not killed"
    finally:
        z.close()
    assert z.proc.returncode == 0


def test_the_fork_server_refuses_to_start_with_the_code_under_test_imported(tmp_path, monkeypatch):
    """A preloaded module of the copy would be the unmutated one in every fork: every mutant would survive."""
    mc = load_script()
    monkeypatch.setenv("MUTATION_ZYGOTE_PRELOAD", "tests.subject")
    copy = _tiny_copy(tmp_path, "def test_nothing():\n    pass\n")
    try:
        mc.Zygote(copy)
    except RuntimeError as e:
        assert "did not start" in str(e)
    else:
        raise AssertionError("the fork server started with tests.subject imported")
