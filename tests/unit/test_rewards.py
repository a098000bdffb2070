"""Reward functions (kuberl.runtime.rewards): registry, math-verify on GSM8K answers, partial credit, import paths."""

from __future__ import annotations

import random
import sys
import types

import pytest

from kuberl.runtime.data import REPEAT_LEN
from kuberl.runtime.rewards import REWARDS, RewardError, RewardRefused, last_boxed, math_final, resolve_reward, score

GSM8K_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether.\n#### 72"


class TestMath:
    def test_a_gsm8k_style_final_answer_matches_the_reference(self):
        math = resolve_reward("math")
        assert math("q", "She sold 24 in May, so 48 + 24 = 72 in total.\n#### 72", GSM8K_ANSWER) == 1.0
        assert math("q", "The answer is $\\boxed{72}$.", GSM8K_ANSWER) == 1.0
        assert math("q", "so the total is 72", GSM8K_ANSWER) == 1.0

    def test_a_wrong_or_missing_answer_scores_zero(self):
        math = resolve_reward("math")
        assert math("q", "#### 71", GSM8K_ANSWER) == 0.0
        assert math("q", "I do not know.", GSM8K_ANSWER) == 0.0
        assert math("q", "", GSM8K_ANSWER) == 0.0

    def test_equivalent_forms_of_a_number_are_accepted(self):
        math = resolve_reward("math")
        assert math("q", "#### 0.5", "#### 1/2") == 1.0
        assert math("q", "#### 1,000", "#### 1000") == 1.0


class TestBoxedAnswer:
    """AReaL's math prompts ask for the answer in \\boxed{}: the last box is the answer, whatever follows it."""

    QUOTED = "So the total is 72 clips. Step 3: check 5 apples."

    def test_without_a_box_free_text_gives_its_last_number(self):
        # The failure the box fixes: math-verify reads the last number of free text.
        assert resolve_reward("math")("q", self.QUOTED, GSM8K_ANSWER) == 0.0

    def test_a_boxed_answer_wins_over_numbers_after_it(self):
        math = resolve_reward("math")
        assert math("q", "So the total is \\boxed{72} clips. Step 3: check 5 apples.", GSM8K_ANSWER) == 1.0
        assert math("q", "So the total is \\boxed{5} clips. Step 3: check 72 apples.", GSM8K_ANSWER) == 0.0

    def test_the_last_box_is_the_answer(self):
        math = resolve_reward("math")
        assert math("q", "First \\boxed{5}, then corrected: \\boxed{72}", GSM8K_ANSWER) == 1.0
        assert math("q", "First \\boxed{72}, then corrected: \\boxed{5}", GSM8K_ANSWER) == 0.0

    def test_nested_braces_are_kept_whole(self):
        assert last_boxed("x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}"
        assert last_boxed("\\boxed{a} and \\boxed {x^{2}+{y}_{1}}.") == "x^{2}+{y}_{1}"
        assert resolve_reward("math")("q", "The ratio is \\boxed{\\frac{1}{2}}; so 7 more.", "#### 0.5") == 1.0

    def test_a_box_cut_off_by_the_token_limit_is_skipped(self):
        assert last_boxed("\\boxed{72} then \\boxed{\\frac{5}{") == "72"
        assert last_boxed("\\boxed{\\frac{5}{") is None
        assert last_boxed("no box, \\boxed 5") is None

    def test_without_a_box_the_gsm8k_marker_and_then_the_whole_text_are_read(self):
        assert math_final("so 72.\n#### 72") == "72"
        assert math_final(self.QUOTED) == self.QUOTED
        assert math_final("\\boxed{72} #### 5") == "\\boxed{72}"


class TestRepeatDigit:
    def test_partial_credit_is_the_fraction_of_leading_characters_that_match(self):
        r = resolve_reward("repeat-digit")
        answer = "7" * REPEAT_LEN
        assert r("Repeat the digit 7.", "7" * REPEAT_LEN, answer) == 1.0
        assert r("Repeat the digit 7.", "7" * REPEAT_LEN + "junk", answer) == 1.0  # only the first k count
        assert r("Repeat the digit 7.", "77x", answer) == pytest.approx(2 / REPEAT_LEN)
        assert r("Repeat the digit 7.", "", answer) == 0.0
        assert r("Repeat the digit 7.", "x7777777", answer) == pytest.approx((REPEAT_LEN - 1) / REPEAT_LEN)

    def test_a_random_policy_scores_low(self):
        rng = random.Random(0)
        r = resolve_reward("repeat-digit")
        alphabet = [chr(c) for c in range(32, 127)]
        mean = sum(r("p", "".join(rng.choice(alphabet) for _ in range(REPEAT_LEN)), "3" * REPEAT_LEN) for _ in range(500)) / 500
        assert mean < 0.05


def test_exact_match_and_add_small():
    assert resolve_reward("exact-match")("q", "  Paris \n", "Paris") == 1.0
    assert resolve_reward("exact-match")("q", "paris", "Paris") == 0.0
    assert resolve_reward("add-small")("What is 3 + 4?", "7 is the sum", "7") == 1.0
    assert resolve_reward("add-small")("What is 3 + 4?", "It is 8", "7") == 0.0
    assert resolve_reward("add-small")("What is 3 + 4?", "none", "7") == 0.0


def test_every_registered_reward_returns_a_number_in_the_unit_interval():  # user rewards may use any finite range
    for name, fn in REWARDS.items():
        for completion in ["", "7777", "#### 5", "abc"]:
            assert 0.0 <= score(fn, "Repeat the digit 7.", completion, "7777", name=name) <= 1.0


def test_an_import_path_loads_a_user_function(monkeypatch):
    mod = types.ModuleType("user_rewards_for_test")
    mod.length_reward = lambda p, c, a: min(len(c) / 10, 1.0)
    mod.not_callable = 3
    monkeypatch.setitem(sys.modules, "user_rewards_for_test", mod)
    assert resolve_reward("user_rewards_for_test:length_reward")("q", "12345", "") == 0.5
    with pytest.raises(RewardError, match="has no attribute 'missing'"):
        resolve_reward("user_rewards_for_test:missing")
    with pytest.raises(RewardError, match="is a int, not a function"):
        resolve_reward("user_rewards_for_test:not_callable")


def test_unknown_names_and_modules_give_clear_errors():
    with pytest.raises(RewardError, match=r"unknown reward 'nope' \(registered: .*math"):
        resolve_reward("nope")
    with pytest.raises(RewardError, match="cannot import module 'no_such_module_xyz'"):
        resolve_reward("no_such_module_xyz:f")


def test_score_accepts_any_finite_number_and_refuses_nan_infinity_and_non_numbers():
    assert score(lambda p, c, a: -1, "q", "c", "a") == -1.0
    assert score(lambda p, c, a: 3.5, "q", "c", "a") == 3.5
    assert score(lambda p, c, a: True, "q", "c", "a") == 1.0
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(RewardRefused, match="workflow.reward mine: returned .*expected a finite number"):
            score(lambda p, c, a, bad=bad: bad, "q", "c", "a", name="mine")
    with pytest.raises(RewardRefused, match=r"returned 'yes' \(str\)"):
        score(lambda p, c, a: "yes", "q", "c", "a", name="mine")
    assert issubclass(RewardRefused, RewardError)
