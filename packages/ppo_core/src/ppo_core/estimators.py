"""Every advantage estimator verl registers, by its ``algorithm.adv_estimator`` name.

The functions take different inputs (GAE a critic's values, ReMax the greedy response's
score, the optimal token baseline Σπ²), so the registry maps a name to the function and a
caller passes what that function's signature asks for; ``*_vectorized`` are verl's faster
twins of ``grpo`` and ``rloo`` and map to the same functions here.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from ppo_core.advantages import (
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_rloo_advantages,
)
from ppo_core.group_advantages import (
    compute_gpg_advantages,
    compute_grpo_passk_advantages,
    compute_opo_advantages,
    compute_reinforce_pp_baseline_advantages,
    compute_remax_advantages,
)
from ppo_core.options import ADVANTAGE_ESTIMATOR_NAMES
from ppo_core.token_baseline import compute_optimal_token_baseline_advantages

ADVANTAGE_ESTIMATORS: dict[str, Callable] = {
    "gae": compute_gae,
    "grpo": compute_grpo_advantages,
    "grpo_vectorized": compute_grpo_advantages,
    "grpo_passk": compute_grpo_passk_advantages,
    "reinforce_plus_plus": compute_reinforce_pp_advantages,
    "reinforce_plus_plus_baseline": compute_reinforce_pp_baseline_advantages,
    "remax": compute_remax_advantages,
    "rloo": compute_rloo_advantages,
    "rloo_vectorized": compute_rloo_advantages,
    "opo": compute_opo_advantages,
    "gpg": compute_gpg_advantages,
    "optimal_token_baseline": compute_optimal_token_baseline_advantages,
    "tir_optimal_token_baseline": partial(
        compute_optimal_token_baseline_advantages, by_token_count=True, handle_zero_tail=True
    ),
}
"""verl's ``algorithm.adv_estimator`` names → the function (:data:`ADVANTAGE_ESTIMATOR_NAMES`)."""
assert tuple(ADVANTAGE_ESTIMATORS) == ADVANTAGE_ESTIMATOR_NAMES
