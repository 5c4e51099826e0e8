"""ReMax's baseline (Li et al., 2023, arXiv:2310.10505; verl's ``adv_estimator=remax``): a
rollout source that, besides the step's samples, answers each of this rank's prompts once
greedily with the same weights and scores that answer with the rule reward (shaped, like
the samples' reward, by the overlong penalty when it is on). Every sample of the prompt
gets that score as its baseline: A_t = G_t − b (:func:`ppo_core.compute_remax_advantages`).

The greedy answers are generated while the engine is awake, after the samples and before
it sleeps; they need no collective (each rank answers its own prompts, which the
re-split by tokens has already placed), so the baseline of a prompt is the same at every
world size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from klppo_train.data.datasets import PromptItem
from klppo_train.ppo.rollouts import Collected, OverColocated
from klppo_train.ppo.shaping import OverlongShaping
from klppo_train.runtime.process_group import rank_span
from klppo_train.workers.trajectories import Trajectories, trajectories


@dataclass
class GreedyBaseline(OverColocated):
    """A :class:`klppo_train.ppo.rollouts.RolloutSource` over ``inner``'s engine whose
    :class:`Collected` carries ``baselines`` ``[N]``; ``score(items, trajectories)``: the
    rule rewards ``[N]``; ``shaping``: the overlong penalty, when on."""

    score: Callable[[Sequence[PromptItem], Trajectories], torch.Tensor]
    shaping: OverlongShaping | None = None

    def collect(self, items: Sequence[PromptItem], step: int) -> Collected:
        span = rank_span(len(items))
        start = time.perf_counter()
        mine, t, metrics = self.inner.generate(items[span.start : span.stop], step, span)
        metrics["timing_s/gen"] = time.perf_counter() - start
        start = time.perf_counter()
        greedy = self.greedy_rewards(mine, step)
        metrics["timing_s/gen_baseline"] = time.perf_counter() - start
        metrics["reward/greedy_baseline/mean"] = float(greedy.mean()) if len(greedy) else 0.0
        metrics.update(self.inner.rest())
        baselines = greedy.to(t.response_mask.device)[t.prompt_index]
        return Collected(mine, t, metrics, baselines=baselines)

    def greedy_rewards(self, items: Sequence[PromptItem], step: int) -> torch.Tensor:
        """``[len(items)]``: the reward of one greedy answer to each prompt."""
        if not items:
            return torch.zeros(0)
        inner = self.inner
        batch = inner.sampler.sample(items, inner.plan.sampling.for_baseline(step))
        t = trajectories(
            [i.prompt_ids for i in items],
            batch,
            pad_token_id=inner.pad_token_id,
            response_length=inner.plan.response_length,
        )
        rewards = self.score(items, t)
        if self.shaping is not None:
            rewards = self.shaping(rewards, t.response_mask)[0]
        order = torch.argsort(t.prompt_index)  # one answer per prompt, in prompt order
        return rewards[order]
