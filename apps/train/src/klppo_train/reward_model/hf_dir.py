"""A reward model's HF directory: what it holds and how klppo reads it.

On disk it is a plain ``AutoModelForSequenceClassification`` directory (``num_labels=1``,
the backbone plus a bias-free linear ``score`` head: OpenRLHF's and TRL's layout), with the
validation scores' ``mean`` and ``std`` in its config (OpenRLHF's names), so transformers,
vLLM's ``/classify`` and other trainers load it as is. klppo's passes load the same weights
as ``AutoModelForTokenClassification`` without a bias (identical parameters), which gives
the head's output at every token of a packed row; the score is read at the response's last
token (:func:`klppo_train.workers.forward.response_scores`).

Reading one needs no torch (the checks before any model loads); making one:
:mod:`klppo_train.reward_model.export`.
"""

from __future__ import annotations

import json
from pathlib import Path

SCORE_KINDS = ("ForSequenceClassification", "ForTokenClassification")


def is_reward_model_dir(path: Path) -> bool:
    """Whether ``path`` holds a model with a scalar score head (not a causal LM)."""
    config = json.loads((Path(path) / "config.json").read_text())
    return any(a.endswith(SCORE_KINDS) for a in config.get("architectures") or ())


def stored_normalization(path: Path) -> tuple[float, float] | None:
    """``(mean, std)`` a reward model's config holds, or None."""
    config = json.loads((Path(path) / "config.json").read_text())
    if "mean" in config and "std" in config:
        return float(config["mean"]), float(config["std"])
    return None


def same_tokenization(tokenizer, other) -> bool:
    """Whether ``other`` reads ``tokenizer``'s token ids as they are: the same vocabulary and
    the same chat template (a reward model and the policy; two ensemble members)."""
    return tokenizer.get_vocab() == other.get_vocab() and getattr(
        tokenizer, "chat_template", None
    ) == getattr(other, "chat_template", None)
