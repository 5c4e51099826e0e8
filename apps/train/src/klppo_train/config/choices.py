"""The names config keys accept, without torch: the checks run before torch loads
(``klppo-train foo.bar=1`` answers in about a second). The modules that implement the
choices import their names from here."""

from __future__ import annotations

ADV_ESTIMATORS = (
    "gae", "grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized",
    "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "gpg", "remax",
    "optimal_token_baseline", "tir_optimal_token_baseline",
)  # fmt: skip
"""algorithm.adv_estimator (klppo_train.ppo.algorithm; the math: ppo_core.ADVANTAGE_ESTIMATORS)."""

GROUP_ESTIMATORS = ("grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized")
"""Estimators that compare a prompt's samples with each other: they need rollout.n >= 2."""

TOKEN_BASELINE_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")
"""Estimators that read Σπ² and log π_old of the old-log-prob pass (which then always runs)."""

VARLEN = "klppo_varlen"
"""klppo's packed attention (klppo_train.runtime.packed_attention)."""

ATTN_IMPLEMENTATIONS = ("auto", VARLEN, "flash_attention_2", "sdpa", "eager")
"""model.attn_implementation."""

DTYPES = ("float32", "bfloat16", "auto")
"""model.dtype (klppo_train.runtime.precision)."""

SCHEDULES = ("constant", "cosine")
"""actor.lr_scheduler and the other optimizers' (klppo_train.trainer.schedule)."""
