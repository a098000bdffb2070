"""The mutation tier: each bug in scripts/mutation-check.py's table, planted one at a time in a copy of the code,
must make one of its named tests fail (the RL algorithm's weights, clip, baseline and temperature; the advantage
variants, GSPO's ratio and the KL term's gradient and reference; the loss denominator across micro-batches and ranks;
dropout detection; the staleness bound; Ulysses context parallel; checkpoints written behind training; a published
version's LM head; weight broadcast; token versions; the agent proxy's sampling, template continuation and budget).

The same check as `python3 scripts/mutation-check.py`, as one pytest test per mutant, so that `scripts/test.sh` runs
it inside its pytest session: there it goes to the worker that does not run the engine files (tests/conftest.py),
which otherwise finishes minutes before the engine worker and waits. The copy is made once per worker, and the
unmutated selections must pass (a mutant "killed" by a test that fails anyway would prove nothing): in the copy, unless
this session runs every one of them itself (the whole suite does, in its unit tier: a failure there fails the session),
which spares two CPU-minutes of running them twice.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.unit.test_mutation_check import ROOT, load_script

MC = load_script()
TIMEOUT = 300  # seconds for one mutant's tests (the script's default); the unmutated baseline gets twice that


def run_here(selection: tuple[str, ...], collected: list[str]) -> bool:
    """Whether this session's own items hold every selected test (a node id, or a file or class prefix of ids)."""
    return all(any(nodeid == t or nodeid.startswith(t + "::") or nodeid.startswith(t + "[") for nodeid in collected) for t in selection)


@pytest.fixture(scope="module")
def copy(request: pytest.FixtureRequest):
    """A copy of kuberl/, operator/, runtime/ and tests/ that imports from itself, whose unmutated selections pass."""
    problems = MC.check_mutants(ROOT, MC.MUTANTS)
    assert not problems, "the mutant table no longer matches the code (scripts/mutation-check.py):\n" + "\n".join(problems)
    with tempfile.TemporaryDirectory(prefix="kuberl-mutants-") as tmp:
        where = MC.make_copy(Path(tmp) / "copy")
        MC.assert_imports_from(where)
        selection = MC.selected_tests(MC.MUTANTS)
        if not run_here(selection, [item.nodeid.partition("@")[0] for item in request.session.items]):
            code, out = MC.run_tests(where, selection, TIMEOUT * 2)
            assert code == 0, f"the mutants' tests fail without any mutant (exit {code}):\n{out[-4000:]}"
        yield where


@pytest.fixture(scope="module")
def zygote(copy):
    """A fork server in the copy: each mutant's pytest starts from a process that imported torch and the rest once."""
    z = MC.Zygote(copy)
    yield z
    z.close()


@pytest.mark.timeout(2 * TIMEOUT + 60)  # the first test also waits for the baseline
@pytest.mark.parametrize("mutant", MC.MUTANTS, ids=[m.id for m in MC.MUTANTS])
def test_the_planted_bug_fails_a_test(copy, zygote, mutant):
    result = MC.run_one(copy, mutant, TIMEOUT, zygote)
    assert result.outcome == "killed", (f"{mutant.id} {result.outcome}: {mutant.what}\n  {mutant.file}: {mutant.old!r} -> {mutant.new!r}\n"
                                        f"  tests: {' '.join(mutant.tests)}\n  {result.detail}")
