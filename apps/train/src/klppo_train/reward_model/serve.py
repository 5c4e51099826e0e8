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

:class:`RewardModelEnsemble` scores with several reward models (``reward_model.ensemble``):
each member's raw score standardized by its own stored mean and std, one column per member
(``[N, M]``); :class:`RewardModelReward` reduces the columns by their minimum or mean before
anything else (Coste et al., 2023).
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


@dataclass(frozen=True)
class RewardModelEnsemble:
    """Several reward models scoring the same responses (``reward_model.path`` first, then
    ``reward_model.ensemble.paths``), run one after another within the ``reward_model``
    role's budget (so the probe measures one member: :attr:`probed`).

    Returns ``[N, M]``: member m's score standardized by its own stored statistics,
    ``(raw_m − μ_m) / σ_m`` (each export's validation scores: ``config.json``'s mean/std),
    so that members trained from different seeds or data score on one scale before
    :meth:`RewardModelReward.combined` takes their minimum or mean.
    """

    members: tuple[RewardModelPass, ...]
    standardize: tuple[tuple[float, float], ...]  # (μ_m, σ_m) per member

    @property
    def name(self) -> str:
        return self.members[0].name

    @property
    def probed(self) -> RewardModelPass:
        return self.members[0]

    @torch.no_grad()
    def compute(self, t: Trajectories, budget: int, items: Sequence = ()) -> torch.Tensor:
        columns = [
            (member.compute(t, budget, items) - mean) / std
            for member, (mean, std) in zip(self.members, self.standardize, strict=True)
        ]
        return torch.stack(columns, dim=1)

    def __call__(self, t: Trajectories, budgets: RunBudgets, step: int, items: Sequence = ()):
        return self.probed.run(budgets, step, lambda budget: self.compute(t, budget, items))


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

    With an ensemble (``scoring`` a :class:`RewardModelEnsemble`) ``raw`` is ``[N, M]`` and
    is first reduced over the members: ``min_m`` (``reduce=min``: Coste et al.'s worst-case
    optimization) or ``mean_m`` (``mean``); everything above then applies to the result.

    ``mean``/``std``: 0/1 (``normalize=none``), the model's stored ones (``stored``), or
    measured by :meth:`calibrate` (``reference``). Saves and loads them (a ``Stateful``).
    """

    scoring: RewardModelPass | RewardModelEnsemble
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
    reduce: str = "min"  # an ensemble's members: min | mean

    @property
    def uses_rule(self) -> bool:
        return self.combine != "rm"

    @property
    def scoring_pass(self) -> RewardModelPass:
        """The pass the budget probe measures (an ensemble's first member)."""
        return getattr(self.scoring, "probed", self.scoring)

    def combined(self, raw: torch.Tensor) -> torch.Tensor:
        """``[N]``: raw scores as they are, or an ensemble's ``[N, M]`` reduced."""
        if raw.dim() == 1:
            return raw
        return raw.min(dim=1).values if self.reduce == "min" else raw.mean(dim=1)

    def score(self, raw: torch.Tensor, t: Trajectories) -> torch.Tensor:
        """The reward model's part of the reward ``[N]`` (normalized, clipped, penalized)."""
        score = (self.combined(raw) - self.mean) / self.std
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
            "reward_model/raw_score/mean": float(self.combined(raw).mean()),
            **_member_metrics(raw),
        }
        if self.combine == "rule":
            return rule, metrics
        if self.combine == "sum":
            return score + self.rule_weight * rule, metrics
        return score, metrics

    def set_normalization(self, scores: torch.Tensor) -> dict[str, float]:
        """Ziegler's: mean 0 / std 1 for these (the reference policy's) raw scores."""
        scores = self.combined(scores).double()
        self.mean, self.std = float(scores.mean()), float(scores.std().clamp(min=1e-6))
        self.calibrated = {"mean": self.mean, "std": self.std, "samples": float(len(scores))}
        return self.calibrated

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": self.std, "calibrated": self.calibrated}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean, self.std = float(state["mean"]), float(state["std"])
        self.calibrated = dict(state.get("calibrated", {}))


def _member_metrics(raw: torch.Tensor) -> dict[str, float]:
    """An ensemble's per-member (standardized) mean scores and their disagreement: the mean
    over responses of the members' standard deviation (Coste et al.'s uncertainty)."""
    if raw.dim() == 1:
        return {}
    metrics = {
        f"reward_model/member{m}/score/mean": float(raw[:, m].mean()) for m in range(raw.shape[1])
    }
    metrics["reward_model/ensemble/disagreement"] = float(raw.std(dim=1).mean())
    return metrics
