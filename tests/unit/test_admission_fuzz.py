"""kuberl.testing.admission_fuzz: deterministic, every mutation kind, at least 10,000 distinct manifests (issue #36)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from kuberl.testing import admission_fuzz as fuzz


@pytest.fixture(scope="module")
def ten_thousand() -> list[fuzz.Case]:
    return list(fuzz.generate(10_000))


def key(case: fuzz.Case) -> str:
    return json.dumps(case.doc, sort_keys=True)


def test_ten_thousand_distinct_manifests(ten_thousand):
    assert len(ten_thousand) == 10_000
    assert len({key(c) for c in ten_thousand}) == 10_000
    assert all(json.loads(json.dumps(c.doc)) == c.doc for c in ten_thousand)  # plain JSON: what the runner posts


def test_the_same_seed_gives_the_same_manifests_and_another_seed_others(ten_thousand):
    again = list(fuzz.generate(500))
    assert [(c.index, c.source, c.mutations, key(c)) for c in again] == [(c.index, c.source, c.mutations, key(c)) for c in ten_thousand[:500]]
    assert fuzz.make_case(1234) == fuzz.make_case(1234)  # one case alone, without the ones before it
    other = list(fuzz.generate(500, seed=7))
    n = len(fuzz.seeds())
    assert [key(c) for c in other[:n]] == [key(c) for c in ten_thousand[:n]]  # the seeds come first, unchanged
    assert len({key(c) for c in other[n:]} & {key(c) for c in ten_thousand[n:500]}) < 10


def test_every_example_and_invalid_manifest_is_a_seed_and_comes_first_unchanged(ten_thousand):
    sources = [s for s, _ in fuzz.seeds()]
    examples = {s for s in sources if s.startswith("examples/")}
    invalid = {s for s in sources if s.startswith("tests/invalid/")}
    assert len(examples) >= 15 and len(invalid) >= 70  # not-yaml.yaml is the one left out
    assert "tests/invalid/not-yaml.yaml" not in invalid
    assert all(c.source == sources[c.index] and c.mutations == () and c.kinds == ("seed",) for c in ten_thousand[: len(sources)])


def test_every_mutation_kind_is_well_represented(ten_thousand):
    kinds = Counter(k for c in ten_thousand for k in set(c.kinds))
    assert set(kinds) == {*fuzz.MUTATIONS, "seed"}
    assert all(n >= 200 for k, n in kinds.items() if k not in ("seed", "random_subtree", "status")), kinds
    assert kinds["random_subtree"] >= 100 and kinds["status"] >= 100
    assert Counter(c.source for c in ten_thousand)["synthesized"] >= 1000
    assert sum(len(c.mutations) > 1 for c in ten_thousand) >= 2000  # combinations, not one change at a time


@pytest.mark.parametrize("name", sorted(fuzz.MUTATIONS))
def test_each_mutation_changes_the_manifest_and_says_where(name):
    changed = 0
    for i in range(40):
        rng = fuzz.random.Random(f"unit/{name}/{i}")
        base = fuzz.seeds()[i % 15][1]
        doc = json.loads(json.dumps(base))
        where = fuzz.MUTATIONS[name](rng, doc)
        assert isinstance(where, str) and where
        changed += doc != base
    assert changed >= 25, f"{name} changed only {changed} of 40 manifests"


def test_cel_combos_reach_both_sides_of_the_cel_rules(ten_thousand):
    # The CEL-governed fields in combination: both admitted and refused combinations must come out.
    from kuberl.api.validation import check_admission

    combos = [c for c in ten_thousand if c.kinds == ("cel_combo",)][:300]
    admitted = sum(check_admission(c.doc)[1] is not None for c in combos)
    assert 20 <= admitted <= 280, admitted  # the allocation rules refuse more combos since they moved into CEL


def test_metadata_namespace_is_only_the_runner_namespace_or_a_wrong_type():
    assert all(v == fuzz.NAMESPACE or not isinstance(v, str) for v in fuzz.METADATA["namespace"])
