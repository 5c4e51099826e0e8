"""Token-budget rules of thumb."""

import pytest

from batching import check_token_budgets, suggest_token_budgets


def levels(findings):
    return [(f.level, f.key) for f in findings]


def test_suggested_budgets_pass_the_checks() -> None:
    # L = 1024 + 3072 = 4096: actor 3L, log-prob 2x actor, critic 4x actor
    budgets = suggest_token_budgets(1024, 3072)
    assert (budgets.actor, budgets.log_prob, budgets.critic) == (12288, 24576, 49152)
    assert (
        check_token_budgets(
            1024, 3072, actor=budgets.actor, log_prob=budgets.log_prob, critic=budgets.critic
        )
        == []
    )


def test_budget_below_one_sequence_is_an_error() -> None:
    found = check_token_budgets(1024, 3072, actor=4000, log_prob=3000, critic=100_000)
    assert levels(found)[:2] == [("error", "actor"), ("error", "log_prob")]
    assert "4000 is below max_prompt_len + max_response_len = 4096" in found[0].message


def test_actor_thresholds() -> None:
    kwargs = {"log_prob": 100_000, "critic": 100_000}
    assert levels(check_token_budgets(1000, 1000, actor=3999, **kwargs)) == [("warning", "actor")]
    assert levels(check_token_budgets(1000, 1000, actor=4000, **kwargs)) == [("info", "actor")]
    assert levels(check_token_budgets(1000, 1000, actor=6000, **kwargs)) == []


def test_log_prob_and_critic_rules() -> None:
    found = check_token_budgets(1000, 1000, actor=6000, log_prob=5000, critic=11999)
    assert levels(found) == [("warning", "critic"), ("info", "log_prob")]
    assert "2x (12000)" in found[1].message and "4x (24000) is typical" in found[0].message


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="`max_response_len` must be >= 1, got 0"):
        suggest_token_budgets(100, 0)
    with pytest.raises(ValueError, match="`critic` must be >= 1"):
        check_token_budgets(1, 1, actor=4, log_prob=4, critic=0)
