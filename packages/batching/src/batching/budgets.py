"""Rules of thumb for per-GPU token budgets, as users know them from verl's tuning guide.

With L = max_prompt_len + max_response_len (the longest possible sequence):

- actor (``ppo_max_token_len_per_gpu``): must be ≥ L or one sequence cannot fit; ≥ 2·L
  is advised so micro-batches hold more than one long sequence; 3·L is recommended.
- log-prob (``log_prob_max_token_len_per_gpu``): forward only, no activations kept for
  backward, so it may be 2x the actor's budget; it must still be ≥ L.
- critic: a value head is cheap next to the LM head's logits, so its budget should be at
  least 2x the actor's (4x is typical).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class BudgetFinding:
    """One rule outcome. ``level`` "error" means the configuration cannot work."""

    level: Literal["error", "warning", "info"]
    key: str
    message: str


@dataclass(frozen=True)
class TokenBudgets:
    """Per-GPU token budgets for the actor update, log-prob passes and the critic."""

    actor: int
    log_prob: int
    critic: int


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"`{name}` must be >= 1, got {value}")


def suggest_token_budgets(max_prompt_len: int, max_response_len: int) -> TokenBudgets:
    """The recommended triple: actor 3·L, log-prob 2x the actor, critic 4x the actor."""
    _check_positive(max_prompt_len=max_prompt_len, max_response_len=max_response_len)
    actor = 3 * (max_prompt_len + max_response_len)
    return TokenBudgets(actor=actor, log_prob=2 * actor, critic=4 * actor)


def _fits_one_sequence(key: str, budget: int, longest: int) -> list[BudgetFinding]:
    if budget >= longest:
        return []
    message = (
        f"{key}={budget} is below max_prompt_len + max_response_len = {longest}: "
        "a single full-length sequence cannot fit in one micro-batch"
    )
    return [BudgetFinding("error", key, message)]


def check_token_budgets(
    max_prompt_len: int, max_response_len: int, *, actor: int, log_prob: int, critic: int
) -> list[BudgetFinding]:
    """Check budgets against the rules above; an empty list means all is well.

    Args:
        max_prompt_len: longest prompt, tokens.
        max_response_len: longest response, tokens.
        actor: actor update budget per GPU (tokens per micro-batch).
        log_prob: log-prob (old/ref) forward budget per GPU.
        critic: critic budget per GPU.

    Returns:
        Findings, errors first.
    """
    _check_positive(
        max_prompt_len=max_prompt_len,
        max_response_len=max_response_len,
        actor=actor,
        log_prob=log_prob,
        critic=critic,
    )
    longest = max_prompt_len + max_response_len
    found = [
        *_fits_one_sequence("actor", actor, longest),
        *_fits_one_sequence("log_prob", log_prob, longest),
        *_fits_one_sequence("critic", critic, longest),
    ]
    if longest <= actor < 2 * longest:
        found.append(
            BudgetFinding(
                "warning",
                "actor",
                f"actor={actor} is under 2x the longest "
                f"sequence ({2 * longest}); 3x ({3 * longest}) is recommended",
            )
        )
    elif 2 * longest <= actor < 3 * longest:
        found.append(
            BudgetFinding(
                "info",
                "actor",
                f"actor={actor}: 3x the longest sequence ({3 * longest}) is recommended",
            )
        )
    if log_prob < actor and log_prob >= longest:
        found.append(
            BudgetFinding(
                "info",
                "log_prob",
                f"log_prob={log_prob} is below the "
                f"actor's {actor}; forward-only passes can take 2x ({2 * actor})",
            )
        )
    if critic < 2 * actor and critic >= longest:
        found.append(
            BudgetFinding(
                "warning",
                "critic",
                f"critic={critic} is under 2x the "
                f"actor's budget ({2 * actor}); 4x ({4 * actor}) is typical",
            )
        )
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(found, key=lambda f: order[f.level])
