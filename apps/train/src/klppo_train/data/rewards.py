"""Rule-based rewards, dispatched on a row's ``data_source``.

Built in: ``"openai/gsm8k"`` / ``"gsm8k"`` (:func:`gsm8k_score`, verl's rule) and
``"arithmetic"`` (:func:`arithmetic_score`, exact), ``"arithmetic_chat"``
(:func:`arithmetic_final_number_score`: the response's last number).
Anything else goes to a user function loaded
with :func:`load_custom_reward` from ``"path/to/file.py:function"``.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from pathlib import Path

from klppo_train.data.user_code import load_user_file

RewardFn = Callable[[str, str, str, dict | None], float]
"""``(data_source, solution_str, ground_truth, extra_info) -> score``."""

GSM8K_METHODS = ("strict", "flexible")
# verl only looks at the tail: regexes over long generations are slow, and the final answer
# is at the end anyway. Kept so scores match verl's.
_SOLUTION_CLIP_CHARS = 300
_STRICT_ANSWER = re.compile(r"#### \$?(-?[0-9.,]+)")
_ANY_NUMBER = re.compile(r"-?[0-9.,]+")


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The final answer of a GSM8K-style response, or None if there is none.

    ``"strict"``: the number after the last ``"#### "`` (an optional ``$`` after it is
    skipped), commas removed; ``"72."`` stays ``"72."`` as in verl. ``"flexible"``: the last
    number anywhere, commas removed and trailing dots stripped. Only the last 300 characters
    are searched (verl's clip).
    """
    if method not in GSM8K_METHODS:
        raise ValueError(f"gsm8k method must be one of {GSM8K_METHODS}, got {method!r}")
    tail = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT_ANSWER.findall(tail)
        return found[-1].replace(",", "") if found else None
    for candidate in reversed(_ANY_NUMBER.findall(tail)):
        number = candidate.replace(",", "").rstrip(".")
        # The class also matches lone "," / "." / "-": those are punctuation, not numbers.
        if any(c.isdigit() for c in number):
            return number
    return None


def gsm8k_score(
    solution_str: str,
    ground_truth: str,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """verl's GSM8K reward: ``score`` if right, ``format_score`` if answered but wrong, else 0.

    The answer is compared as a string with ``ground_truth`` (a plain number such as
    ``"1234"`` or ``"-3"``, as written by ``klppo_train.data.datasets``); see
    :func:`extract_gsm8k_answer` for what counts as an answer.
    """
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == str(ground_truth).strip() else float(format_score)


def arithmetic_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the response is exactly the answer, else 0.0.

    What counts: the response with surrounding whitespace removed, then one trailing ``.``
    and the whitespace before it removed, must equal ``ground_truth`` (stripped) character
    for character. So ``"7"``, ``" 7.\\n"`` and ``"-3"`` count; ``"07"``, ``"7.0"``, ``"+7"``,
    ``"7!"`` and ``"The answer is 7"`` do not (the prompt asks for just the number). The
    caller decodes without special tokens, so no EOS text is stripped here.
    """
    answer = solution_str.strip()
    if answer.endswith("."):
        answer = answer[:-1].rstrip()
    return 1.0 if answer and answer == str(ground_truth).strip() else 0.0


_NUMBER = re.compile(r"-?\d+")


def arithmetic_final_number_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the response's last number is the answer ("12", "3 * 4 = 12", "The answer is
    12."), else 0.0 ("12 or 13" ends on 13). For a chat model that answers in sentences:
    what is scored is being right, not the form (SmolLM2-135M-Instruct never answers with
    the bare number, even sampled: 0 of 256 samples)."""
    numbers = _NUMBER.findall(solution_str.replace(",", ""))
    return 1.0 if numbers and numbers[-1] == str(ground_truth).strip() else 0.0


_ANSWER_IS = re.compile(r"answer is\s*(-?\d+)", re.IGNORECASE)


def answer_is_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the response's last "answer is <n>" names the answer, else 0.0. For tool use:
    a multi-turn response holds the tools' answers too (the rule reads the whole response,
    as verl's does), and a calculator's answer is a bare number, so a last-number rule
    would pay a model that stops after the tool answered; this one pays only the model's
    own statement of the answer."""
    found = _ANSWER_IS.findall(solution_str.replace(",", ""))
    return 1.0 if found and found[-1] == str(ground_truth).strip() else 0.0


def load_custom_reward(spec: str) -> RewardFn:
    """Load ``function`` from ``"path/to/file.py:function"``.

    The function is called as ``fn(data_source, solution_str, ground_truth, extra_info)``
    and must return a number.

    Raises:
        ValueError: a malformed spec, a missing or non-callable function, or one that
            cannot take those four arguments, naming the spec.
        FileNotFoundError: the file does not exist, naming it.
    """
    path_str, sep, name = spec.rpartition(":")
    if not sep or not path_str or not name.isidentifier():
        raise ValueError(f"custom reward {spec!r} must look like 'path/to/file.py:function'")
    path = Path(path_str)
    if not path.is_file():
        raise FileNotFoundError(f"custom reward file {path_str!r} (from {spec!r}) does not exist")
    module = load_user_file(path, "klppo_custom_reward")
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"custom reward {spec!r}: {path_str!r} has no function {name!r}")
    try:
        inspect.signature(fn).bind("data_source", "solution", "ground_truth", {})
    except TypeError as err:
        raise ValueError(
            f"custom reward {spec!r}: {name}() must accept (data_source, solution_str, "
            f"ground_truth, extra_info): {err}"
        ) from None
    return fn


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "openai/gsm8k": lambda ds, sol, gt, extra: gsm8k_score(sol, gt),
    "gsm8k": lambda ds, sol, gt, extra: gsm8k_score(sol, gt),
    "arithmetic": lambda ds, sol, gt, extra: arithmetic_score(sol, gt),
    "arithmetic_chat": lambda ds, sol, gt, extra: arithmetic_final_number_score(sol, gt),
    "calculator_multiply": lambda ds, sol, gt, extra: answer_is_score(sol, gt),
}


class RewardManager:
    """Scores responses with the built-in reward of their ``data_source`` or a custom one.

    ``custom`` (a function or a ``"file.py:function"`` spec), when given, scores every data
    source — as verl's ``custom_reward_function`` does; without it, the built-in reward of
    the row's ``data_source`` is used. A reward function that raises, or returns something
    that is not a finite number, scores 0.0 and is counted in ``errors`` (metric
    ``reward/errors``); with ``strict=True`` the exception propagates instead.

    Args:
        custom: the reward for every row, or None for the built-ins.
        strict: re-raise reward-function errors instead of counting them.
    """

    def __init__(self, custom: RewardFn | str | None = None, strict: bool = False):
        self.custom = load_custom_reward(custom) if isinstance(custom, str) else custom
        self.strict = strict
        self.errors = 0

    def reward_fn(self, data_source: str) -> RewardFn:
        """The function that scores ``data_source``; ValueError naming it if there is none."""
        fn = self.custom or BUILTIN_REWARDS.get(data_source)
        if fn is None:
            raise ValueError(
                f"data_source {data_source!r} has no built-in reward "
                f"{sorted(BUILTIN_REWARDS)}; "
                "set reward.custom=path/to/file.py:function"
            )
        return fn

    def has_rule(self, data_source: str) -> bool:
        """Whether ``data_source`` has a reward function (custom or built in)."""
        return self.custom is not None or data_source in BUILTIN_REWARDS

    def score(
        self, data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
    ) -> float:
        """The reward of one response. An unknown ``data_source`` always raises ValueError."""
        fn = self.reward_fn(data_source)
        try:
            value = float(fn(data_source, solution_str, ground_truth, extra_info))
            if not math.isfinite(value):
                raise ValueError(f"reward for data_source {data_source!r} is {value}")
        except Exception:
            if self.strict:
                raise
            self.errors += 1
            return 0.0
        return value

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """``{"reward/errors": count}``; ``reset=True`` starts a new count (per-step use)."""
        out = {"reward/errors": float(self.errors)}
        if reset:
            self.errors = 0
        return out
