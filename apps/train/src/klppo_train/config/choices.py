"""The names config keys accept, without torch: the checks run before torch loads
(``klppo-train foo.bar=1`` answers in about a second). The modules that implement the
choices import their names from here."""

from __future__ import annotations

ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus")
"""algorithm.adv_estimator (klppo_train.ppo.algorithm)."""

VARLEN = "klppo_varlen"
"""klppo's packed attention (klppo_train.runtime.packed_attention)."""

ATTN_IMPLEMENTATIONS = ("auto", VARLEN, "flash_attention_2", "sdpa", "eager")
"""model.attn_implementation."""

DTYPES = ("float32", "bfloat16", "auto")
"""model.dtype (klppo_train.runtime.precision)."""

SCHEDULES = ("constant", "cosine")
"""actor.lr_scheduler and the other optimizers' (klppo_train.trainer.schedule)."""
