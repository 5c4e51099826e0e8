"""DAPO's dynamic sampling (Yu et al., 2025; verl's ``algorithm.filter_groups``): a rollout
source that drops the prompt groups whose samples all score alike and generates the next
batches of prompts until the step holds ``data.train_batch_size`` prompts (each round
``data.gen_batch_size`` prompts, verl's; by default the same).

A group whose rewards are all equal has zero advantage under GRPO-style estimators (and
only noise under GAE): it costs a forward and backward pass and teaches nothing. As in verl,
each round generates one loader batch with the current weights (so every kept sample is
on-policy), scores it with the rule reward, keeps the groups whose metric varies (a group of
one sample is kept), and stops when the kept prompts over all ranks reach the batch size;
the first ``data.train_batch_size`` kept groups in generation order are trained on (verl's
``batch[:size]``), the last round's surplus is dropped. ``max_num_gen_batches`` rounds
without a full batch stop the run with the reason (verl raises too; 0 = no limit).

Under torchrun each rank generates and filters its share of every round (seeded by the
prompt's place, as every step's samples are); the kept groups' places are gathered, so all
ranks take the same rounds and choose the same groups, which are then re-split over the
ranks by tokens (whatever ``trainer.balance_batch`` says: the ranks keep different numbers)
at the places one process would give them: the step does not change with the world size.
The rule scores travel with the rollouts (:attr:`Collected.rule`): the step does not score
the samples again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from klppo_train.config.errors import UserError
from klppo_train.data.datasets import PromptItem
from klppo_train.ppo.rollouts import Collected, OverColocated
from klppo_train.ppo.shaping import OverlongShaping
from klppo_train.runtime.process_group import concat_over_ranks, rank_span
from klppo_train.workers.trajectories import Trajectories, trajectories
from rollout import RolloutBatch, Sample


@dataclass(frozen=True)
class GroupFilter:
    """``algorithm.filter_groups``, read once: ``metric`` acc (the rule reward) | score |
    seq_reward (the rule reward shaped by ``shaping``, DAPO's overlong penalty);
    ``max_num_gen_batches`` (0 = no limit)."""

    metric: str = "acc"
    max_num_gen_batches: int = 0
    shaping: OverlongShaping | None = None

    def values(self, rule: torch.Tensor, t: Trajectories) -> torch.Tensor:
        """``[N]``: what must vary within a group."""
        if self.metric == "acc" or self.shaping is None:
            return rule
        return self.shaping(rule, t.response_mask)[0]


def varied_groups(values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: the samples whose group (same ``groups`` id) has values that are not all
    equal, or has a single sample (verl keeps those). ``values``, ``groups``: ``[N]``."""
    ids, index = torch.unique(groups, return_inverse=True)
    high = torch.full((len(ids),), -torch.inf, dtype=values.dtype, device=values.device)
    low = torch.full_like(high, torch.inf)
    high = high.scatter_reduce(0, index, values, "amax")
    low = low.scatter_reduce(0, index, values, "amin")
    size = torch.zeros(len(ids), device=values.device).index_add_(0, index, torch.ones_like(values))
    keep = (high > low) | (size == 1)
    return keep[index]


@dataclass(frozen=True)
class _Group:
    """A kept prompt group of this rank: its place ``key`` over all rounds (round × the round's
    size + its position in the round's batch: sorted keys are generation order), its
    prompt, samples and their rule rewards."""

    key: int
    item: PromptItem
    samples: list[Sample]
    rule: list[float]


@dataclass
class DynamicSampling(OverColocated):
    """A :class:`klppo_train.ppo.rollouts.RolloutSource` over ``inner``'s engine: rounds of
    generation filtered by ``groups`` until the step's batch is full (module docstring).
    ``more()``: the next batch of prompts (the loader's, the same on every rank);
    ``score(items, trajectories)``: the rule rewards ``[N]``."""

    groups: GroupFilter
    more: Callable[[], Sequence[PromptItem]]
    score: Callable[[Sequence[PromptItem], Trajectories], torch.Tensor]
    batch_size: int | None = None  # prompts trained on; None: a round's (len(items))

    def collect(self, items: Sequence[PromptItem], step: int) -> Collected:
        start, size = time.perf_counter(), len(items)  # a round: data.gen_batch_size
        wanted = self.batch_size or size
        stats = self.inner.stats
        counted = stats.counts() if stats else {}
        held: list[_Group] = []
        keys: list[int] = []  # every rank's kept groups' keys
        rounds = constant = 0
        sampled: list = []  # every round's samples, for the sampler's metrics (multi-turn)
        while True:
            kept, dropped = self._round(items, step, rounds * size, sampled)
            rounds += 1
            held += kept
            found = concat_over_ranks({"keys": [g.key for g in kept], "constant": [dropped]})
            keys += found["keys"]
            constant += int(sum(found["constant"]))
            if len(keys) >= wanted:
                break
            if 0 < self.groups.max_num_gen_batches <= rounds:
                raise _too_few(len(keys), wanted, rounds, self.groups.max_num_gen_batches)
            items = self.more()
        mine, t, rule, balance = self._lay_out(held, set(sorted(keys)[:wanted]), step)
        metrics = {
            "train/num_gen_batches": float(rounds),
            "train/kept_groups": float(len(keys)),
            "train/dropped_groups": float(constant),
            **balance,
            **(stats.since(counted) if stats else {}),
            "timing_s/gen": time.perf_counter() - start,
            **self.inner.sampler.metrics(RolloutBatch(sampled, policy_version=step - 1)),
        }
        metrics.update(self.inner.rest())
        return Collected(mine, t, metrics, rule=rule)

    def _round(self, items: Sequence[PromptItem], step: int, offset: int, sampled: list):
        """``(kept groups, number of constant ones)`` of this rank's share of ``items``; the
        round's samples appended to ``sampled``."""
        span = rank_span(len(items))
        mine, keys = items[span.start : span.stop], range(offset + span.start, offset + span.stop)
        batch = self.inner.sample(mine, step, keys)
        sampled += batch.samples
        t = trajectories(
            [i.prompt_ids for i in mine],
            batch,
            pad_token_id=self.inner.pad_token_id,
            response_length=self.inner.plan.response_length,
        )
        rule = self.score(mine, t).tolist()
        keep = varied_groups(self.groups.values(torch.tensor(rule), t), t.prompt_index.cpu())
        rows: dict[int, list[int]] = {}
        for row, index in enumerate(t.prompt_index.tolist()):
            rows.setdefault(index, []).append(row)
        kept = [
            _Group(keys[i], mine[i], [batch.samples[r] for r in rs], [rule[r] for r in rs])
            for i, rs in rows.items()
            if keep[rs[0]]
        ]
        return kept, len(rows) - len(kept)

    def _lay_out(self, held: list[_Group], chosen: set[int], step: int):
        """The chosen groups as the step's trajectories, re-split over the ranks; their
        positions in the step's batch are their places in generation order, as one process
        would have them (so the step does not change with the world size)."""
        mine = [g for g in held if g.key in chosen]
        order = {key: i for i, key in enumerate(sorted(chosen))}
        every = concat_over_ranks({"keys": [g.key for g in mine], "rule": [g.rule for g in mine]})
        samples = [replace(s, prompt_index=j) for j, g in enumerate(mine) for s in g.samples]
        version = min((s.policy_version for s in samples), default=step - 1)
        batch = RolloutBatch(samples, policy_version=version)
        canonical = [order[key] for key in every["keys"]]
        # re-split whatever trainer.balance_batch says: the ranks keep different numbers
        items, t, balance, positions = self.inner.lay_out(
            [g.item for g in mine],
            batch,
            list(range(len(mine))),  # replaced by the re-split's (rank-order) positions
            canonical,
            rebalance=True,
        )
        rule = [r for p in positions for r in every["rule"][p]]
        return items, t, torch.tensor(rule, device=t.response_mask.device), balance


def _too_few(kept: int, wanted: int, rounds: int, limit: int) -> UserError:
    return UserError(
        f"algorithm.filter_groups: {kept} of {wanted} prompts had rewards that vary after "
        f"{rounds} generation batches (max_num_gen_batches={limit}): the data is too hard "
        "or too easy for the policy; raise the limit or set it to 0 for no limit"
    )
