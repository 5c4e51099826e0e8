"""Rule-based rewards, custom reward loading and the dispatching manager."""

import pytest

from klppo_train.data.rewards import (
    RewardManager,
    answer_is_score,
    arithmetic_final_number_score,
    arithmetic_score,
    extract_gsm8k_answer,
    gsm8k_score,
    load_custom_reward,
)


@pytest.mark.parametrize(
    ("solution", "truth", "expected"),
    [
        ("3 + 4 = 7\n#### 7", "7", 1.0),
        ("so the total is\n#### 1,234", "1234", 1.0),
        ("#### $5", "5", 1.0),
        ("first #### 3 then corrected #### 4", "4", 1.0),  # the last one counts
        ("first #### 4 then corrected #### 3", "4", 0.0),  # well-formed, wrong: format_score
        ("#### -12", "-12", 1.0),
        ("#### 12", "-12", 0.0),
        ("#### 72.", "72", 0.0),  # verl keeps the trailing dot
        ("The answer is 7", "7", 0.0),  # no '#### ': no answer
        ("####7", "7", 0.0),  # verl needs the space
        ("", "7", 0.0),
        ("x" * 400 + "#### 7", "7", 1.0),
        ("#### 7" + " " * 300, "7", 0.0),  # only the last 300 characters are searched
    ],
)
def test_gsm8k_strict(solution, truth, expected) -> None:
    assert gsm8k_score(solution, truth) == expected


def test_gsm8k_format_score_and_flexible() -> None:
    assert gsm8k_score("#### 8", "7", format_score=0.1) == 0.1
    assert gsm8k_score("no answer", "7", format_score=0.1) == 0.0
    assert gsm8k_score("#### 7", "7", score=2.0) == 2.0
    flexible = {
        "The answer is 1,234.": "1234",
        "costs $5, right?": "5",
        "-3 degrees, then it's over.": "-3",
        "2 and then 3.5": "3.5",
        "no digits, at all.": None,
    }
    for text, answer in flexible.items():
        assert extract_gsm8k_answer(text, "flexible") == answer, text
    assert gsm8k_score("I think it is 7.", "7", method="flexible") == 1.0
    with pytest.raises(ValueError, match="method must be one of"):
        gsm8k_score("#### 7", "7", method="loose")


@pytest.mark.parametrize(
    ("solution", "truth", "expected"),
    [
        ("7", "7", 1.0),
        (" 7.\n", "7", 1.0),
        ("7 .", "7", 1.0),
        ("-3", "-3", 1.0),
        ("3", "-3", 0.0),
        ("07", "7", 0.0),
        ("7.0", "7", 0.0),
        ("+7", "7", 0.0),
        ("7..", "7", 0.0),
        ("The answer is 7", "7", 0.0),
        ("8", "7", 0.0),
        ("", "7", 0.0),
        (".", "", 0.0),
    ],
)
def test_arithmetic_score(solution, truth, expected) -> None:
    assert arithmetic_score(solution, truth) == expected


@pytest.mark.parametrize(
    ("solution", "expected"),
    [
        ("12", 1.0),
        (" 12.\n", 1.0),
        ("3 * 4 = 12", 1.0),
        ("The answer is 12.", 1.0),
        ("3 * 4 = 1,2", 1.0),  # thousands separators are dropped first
        ("12 or 13", 0.0),  # the last number counts
        ("-12", 0.0),
        ("3 * 4 = 13", 0.0),
        ("twelve", 0.0),
        ("", 0.0),
    ],
)
def test_arithmetic_final_number_score(solution, expected) -> None:
    assert arithmetic_final_number_score(solution, "12") == expected
    assert RewardManager().score("arithmetic_chat", solution, "12", {}) == expected


CUSTOM = """
def length_reward(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "boom":
        raise RuntimeError("broken reward")
    if solution_str == "nan":
        return float("nan")
    return len(solution_str) / 10 + extra_info.get("bonus", 0)

def two_args(solution_str, ground_truth):
    return 0.0
"""


@pytest.fixture
def custom_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    return path


def test_load_custom_reward(custom_file) -> None:
    fn = load_custom_reward(f"{custom_file}:length_reward")
    assert fn("mine", "abcd", "", {"bonus": 1}) == pytest.approx(1.4)
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_custom_reward(f"{custom_file.parent}/nope.py:length_reward")
    with pytest.raises(ValueError, match="has no function 'missing'"):
        load_custom_reward(f"{custom_file}:missing")
    with pytest.raises(ValueError, match=r"two_args\(\) must accept"):
        load_custom_reward(f"{custom_file}:two_args")
    with pytest.raises(ValueError, match="must look like 'path/to/file.py:function'"):
        load_custom_reward(str(custom_file))


def test_manager_dispatch(custom_file) -> None:
    manager = RewardManager()
    assert manager.score("openai/gsm8k", "#### 7", "7", {}) == 1.0
    assert manager.score("gsm8k", "#### 8", "7", None) == 0.0
    assert manager.score("arithmetic", "7.", "7", {}) == 1.0
    with pytest.raises(
        ValueError,
        match=r"data_source 'mine'.*\['arithmetic', 'arithmetic_chat', 'calculator_multiply'",
    ):
        manager.score("mine", "x", "y", {})
    custom = RewardManager(custom=f"{custom_file}:length_reward")
    assert custom.score("mine", "abc", "", {}) == pytest.approx(0.3)
    # a custom reward replaces the built-ins (verl's custom_reward_function)
    assert custom.score("arithmetic", "7", "7", {}) == pytest.approx(0.1)


def test_manager_counts_errors_or_raises(custom_file) -> None:
    manager = RewardManager(custom=f"{custom_file}:length_reward")
    assert manager.score("mine", "boom", "", {}) == 0.0
    assert manager.score("mine", "nan", "", {}) == 0.0
    assert manager.score("mine", "ab", "", None) == 0.0  # None.get raises inside the function
    assert manager.errors == 3
    assert manager.metrics(reset=True) == {"reward/errors": 3.0}
    assert manager.metrics() == {"reward/errors": 0.0}
    strict = RewardManager(custom=load_custom_reward(f"{custom_file}:length_reward"), strict=True)
    with pytest.raises(RuntimeError, match="broken reward"):
        strict.score("mine", "boom", "", {})
    assert strict.errors == 0


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("The answer is 1081.", 1.0),
        ('<tool_call>{"expression": "23*47"}</tool_call>\ntool\n1081\nassistant\n', 0.0),
        ("tool\n1081\nassistant\nThe answer is 1,081.", 1.0),  # thousands separator
        ("The answer is 1080. No, the answer is 1081", 1.0),  # the last statement counts
        ("The answer is 1081. No, the answer is 1080", 0.0),
        ("answer IS -3", 0.0),
    ],
)
def test_answer_is_pays_only_the_models_statement(response, score) -> None:
    """A calculator's bare number in a multi-turn response is not an answer."""
    assert answer_is_score(response, "1081") == score
