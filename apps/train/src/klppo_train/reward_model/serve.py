"""The reward model in the PPO step: its scoring pass and the reward made of its score.

:class:`RewardModelPass` is a frozen, sharded reward model's forward pass over the step's
responses, within the ``reward_model`` role's token budget (a number or ``auto``; halved on
out-of-memory like every pass). It scores the policy's own token ids, or -- when the reward
model's tokenizer or chat template differs (``reward_model.retemplate``) -- the
conversation rendered with the reward model's template: the prompt's messages, then the
response decoded to text and tokenized by the reward model's tokenizer, with its EOS when
the response ended (so the score is read at the same kind of token it was trained on).
Rendered prompts keep their last ``max_prompt_length`` tokens and responses their first
``response_length``, so a sequence never exceeds the budget's minimum.

:class:`RewardModelReward` turns the raw scores into the PPO reward: normalization
(none / the model's stored mean and std / Ziegler et al.'s, measured on the reference
policy's samples at start-up), clipping, the missing-EOS penalty and the combination with
the rule reward. It is a checkpointed ``Stateful`` (the normalization in force).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from klppo_train.budgets.run_budgets import RunBudgets
from klppo_train.workers.forward import response_scores
from klppo_train.workers.passes import ForwardPass
from klppo_train.workers.trajectories import Trajectories
from rollout import left_pad


def same_tokenization(policy_tokenizer, rm_tokenizer) -> bool:
    """Whether the reward model reads the policy's token ids as they are: the same
    vocabulary and the same chat template."""
    return policy_tokenizer.get_vocab() == rm_tokenizer.get_vocab() and getattr(
        policy_tokenizer, "chat_template", None
    ) == getattr(rm_tokenizer, "chat_template", None)


@dataclass(frozen=True)
class Retemplate:
    """Policy samples → the reward model's own rendering (see the module docstring)."""

    policy_tokenizer: Any
    rm_tokenizer: Any
    max_prompt_length: int
    response_length: int
    stop_ids: frozenset[int]

    def __call__(self, t: Trajectories, items: Sequence) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(input_ids, attention_mask, T')``: ``[N, P' + T']`` in verl's layout."""
        rendered = [
            self.render(items[index].messages, t.response_ids[row][t.response_mask[row].bool()])
            for row, index in enumerate(t.prompt_index.tolist())
        ]
        rm = self.rm_tokenizer
        pad = rm.pad_token_id if rm.pad_token_id is not None else rm.eos_token_id
        prompt_ids, prompt_mask = left_pad([p for p, _ in rendered], pad)
        response_ids, response_mask = _right_pad([r for _, r in rendered], pad)
        ids = torch.cat([prompt_ids, response_ids], 1).to(t.input_ids.device)
        mask = torch.cat([prompt_mask, response_mask], 1).to(t.input_ids.device)
        return ids, mask, response_ids.shape[1]

    def render(self, messages, response: torch.Tensor) -> tuple[list[int], list[int]]:
        """One conversation in the reward model's tokens: ``(prompt, response)``."""
        rm, ids = self.rm_tokenizer, response.tolist()
        prompt = rm.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        text = self.policy_tokenizer.decode(ids, skip_special_tokens=True)
        tokens = rm(text, add_special_tokens=False)["input_ids"]
        if ids and ids[-1] in self.stop_ids:  # it ended: end it as the reward model learned
            tokens = tokens + [rm.eos_token_id]
        tokens = tokens[: self.response_length] or [rm.eos_token_id]  # never empty
        return list(prompt)[-self.max_prompt_length :], tokens


def _right_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask


@dataclass(frozen=True, kw_only=True)
class RewardModelPass(ForwardPass):
    """The reward model's scoring pass (``name`` ``reward_model``): raw scores ``[N]``.
    ``retemplate`` None: the policy's token ids as they are."""

    retemplate: Retemplate | None = None

    @torch.no_grad()
    def compute(self, t: Trajectories, budget: int, items: Sequence = ()) -> torch.Tensor:
        if self.retemplate is not None and items:
            ids, mask, width = self.retemplate(t, items)
        else:
            ids, mask, width = t.input_ids, t.attention_mask, t.response_mask.shape[1]
        if self.retemplate is not None and not items:
            # the budget probe's synthetic rows (random policy ids, no conversation): ids the
            # reward model's vocabulary holds, at the same lengths
            ids = ids % self.model.config.vocab_size
        return response_scores(
            self.model, ids, mask, width, max_tokens=budget, micro_batch_size=self.micro_batch_size
        )

    def __call__(self, t: Trajectories, budgets: RunBudgets, step: int, items: Sequence = ()):
        return self.run(budgets, step, lambda budget: self.compute(t, budget, items))


def ended(t: Trajectories, stop_ids: frozenset[int]) -> torch.Tensor:
    """``[N]`` bool: the response's last token is EOS or a configured stop token."""
    positions = torch.arange(t.response_mask.shape[1], device=t.response_mask.device)
    last = torch.where(t.response_mask.bool(), positions, -1).max(dim=1).values
    tokens = t.response_ids.gather(1, last.clamp(min=0)[:, None]).squeeze(1)
    stops = torch.tensor(sorted(stop_ids), device=tokens.device)
    return (last >= 0) & torch.isin(tokens, stops)


@dataclass
class RewardModelReward:
    """The reward model's scoring pass and how its scores become the PPO reward.

    score = clip((raw − mean) / std, ±clip_range) − missing_eos_penalty · [no EOS/stop]
    reward = score (``combine=rm``) | rule (``rule``) | score + rule_weight · rule (``sum``)

    ``mean``/``std``: 0/1 (``normalize=none``), the model's stored ones (``stored``), or
    measured by :meth:`calibrate` (``reference``). Saves and loads them (a ``Stateful``).
    """

    scoring: RewardModelPass
    normalize: str = "none"
    normalize_samples: int = 256
    clip_range: float = 10.0
    missing_eos_penalty: float = 0.0
    stop_ids: frozenset[int] = frozenset()
    combine: str = "rm"
    rule_weight: float = 1.0
    mean: float = 0.0
    std: float = 1.0
    calibrated: dict[str, float] = field(default_factory=dict)

    @property
    def uses_rule(self) -> bool:
        return self.combine != "rm"

    def score(self, raw: torch.Tensor, t: Trajectories) -> torch.Tensor:
        """The reward model's part of the reward ``[N]`` (normalized, clipped, penalized)."""
        score = (raw - self.mean) / self.std
        if self.clip_range:
            score = score.clamp(-self.clip_range, self.clip_range)
        if self.missing_eos_penalty:
            score = score - self.missing_eos_penalty * (~ended(t, self.stop_ids)).float()
        return score

    def reward(
        self, raw: torch.Tensor, rule: torch.Tensor | None, t: Trajectories
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """``(sequence rewards [N], reward_model/* metrics)``."""
        score = self.score(raw, t)
        metrics = {
            "reward_model/score/mean": float(score.mean()),
            "reward_model/score/max": float(score.max()),
            "reward_model/score/min": float(score.min()),
            "reward_model/raw_score/mean": float(raw.mean()),
        }
        if self.combine == "rule":
            return rule, metrics
        if self.combine == "sum":
            return score + self.rule_weight * rule, metrics
        return score, metrics

    def set_normalization(self, scores: torch.Tensor) -> dict[str, float]:
        """Ziegler's: mean 0 / std 1 for these (the reference policy's) raw scores."""
        scores = scores.double()
        self.mean, self.std = float(scores.mean()), float(scores.std().clamp(min=1e-6))
        self.calibrated = {"mean": self.mean, "std": self.std, "samples": float(len(scores))}
        return self.calibrated

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": self.std, "calibrated": self.calibrated}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean, self.std = float(state["mean"]), float(state["std"])
        self.calibrated = dict(state.get("calibrated", {}))
