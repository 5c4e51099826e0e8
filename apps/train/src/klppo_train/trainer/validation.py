"""Validation: greedy answers to the validation prompts, scored by the rule (accuracy per
data source) and, with a reward model, by it (its mean score); the first few as
generations to read (``trainer.log_val_generations``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from fsdp_sharding import default_device
from klppo_train.agents.samplers import conversation, decoder
from klppo_train.ppo.rollouts import StepPlan
from klppo_train.runtime.process_group import concat_over_ranks, dp_size, rank_slice
from klppo_train.workers.trajectories import trajectories
from rollout import RolloutBatch, multi_turn_metrics

VAL_TURN_METRICS = ("multi_turn/turns", "tool/calls_per_sample")  # as val/<name>, per answer


class Validated(Protocol):
    """What validation reads: a run's ``Components``, or ``trainer.val_only``'s
    :class:`klppo_train.trainer.evaluate.Evaluation`."""

    sampler: Any  # the run's (klppo_train.agents.samplers): validation samples as training does
    plan: StepPlan
    tokenizer: Any
    rewards: Any
    reward_model: Any
    budgets: Any


@dataclass
class _Answered:
    """This rank's answered prompts: the items, their samples, and (only when generations
    are recorded) one row per sample, its prompt still as token ids."""

    keep_rows: bool
    items: list = field(default_factory=list)
    samples: list = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    # multi-turn: per answer, its turns and tool calls
    turns: dict[str, list[float]] = field(default_factory=dict)


def validate(
    c: Validated, items, batch_size: int = 0, generations: int = 0
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """``(metrics, rows)``: greedy (``rollout.val_temperature``) accuracy per data source,
    ``val/<source>/acc`` (where the source has a rule), over the whole validation set,
    ``batch_size`` (``data.val_batch_size``) prompts at a time (all at once when 0; each
    rank generates its slice of each batch); with a reward model also its mean score,
    ``val/reward_model/score``, whatever the training reward is. ``rows``: the first
    ``generations`` answers in validation-set order (the same at every world size), each
    ``{data_source, prompt, response, ground_truth, score, reward_model_score}`` with the
    scores the metrics were computed from. Empty without a set."""
    if not items:
        return {}, []
    size = batch_size or len(items)
    hits: dict[str, list[float]] = {}
    answered = _Answered(keep_rows=generations > 0)
    for start in range(0, len(items), size):
        mine = rank_slice(list(enumerate(items))[start : start + size])
        _score_batch(c, mine, hits, answered)
    hits = concat_over_ranks(hits)
    metrics = {f"val/{source}/acc": sum(v) / len(v) for source, v in sorted(hits.items())}
    if c.sampler.multi_turn:  # the same on every rank: concat_over_ranks is a collective
        turns = concat_over_ranks(answered.turns)
        metrics |= {f"val/{k}": sum(v) / len(v) for k, v in sorted(turns.items()) if v}
    if c.reward_model is not None and len(items) >= dp_size():  # every rank has samples
        scores = _reward_model_scores(c, answered)
        if answered.keep_rows:
            for row, score in zip(answered.rows, scores, strict=True):
                row["reward_model_score"] = score
        every = concat_over_ranks({"score": scores})["score"]
        metrics["val/reward_model/score"] = sum(every) / len(every)
    return metrics, _first_rows(c, answered.rows, generations)


def _score_batch(c: Validated, mine: list, hits: dict, answered: _Answered) -> None:
    if not mine:  # a last batch smaller than the world size leaves some ranks none
        return
    batch = c.sampler.sample([item for _, item in mine], c.plan.sampling.for_validation())
    for sample in batch.samples:
        position, item = mine[sample.prompt_index]
        answered.items.append(item)
        answered.samples.append(replace(sample, prompt_index=len(answered.samples)))
        if sample.turns:
            _count_turns(answered.turns, sample)
        ruled = c.rewards.has_rule(item.data_source)
        if not (ruled or answered.keep_rows):
            continue
        text = c.tokenizer.decode(list(sample.response_token_ids), skip_special_tokens=True)
        score = None
        if ruled:
            score = c.rewards.score(item.data_source, text, item.ground_truth, item.extra_info)
            hits.setdefault(item.data_source, []).append(float(score >= 1.0))
        if answered.keep_rows:
            answered.rows.append(_row(position, item, text, score))
            if sample.turns:
                answered.rows[-1]["turns"] = conversation(sample, decoder(c.tokenizer))


def _count_turns(counts: dict[str, list[float]], sample) -> None:
    """One multi-turn answer's :data:`VAL_TURN_METRICS` (kept per answer: the ranks hold
    different numbers of answers, so their means are taken over all of them)."""
    one = multi_turn_metrics([sample])
    for name in VAL_TURN_METRICS:
        counts.setdefault(name, []).append(one[name])


def _row(position: int, item, response: str, score) -> dict[str, Any]:
    return {
        "position": position,
        "data_source": item.data_source,
        "prompt_ids": item.prompt_ids,  # decoded for the rows kept (_first_rows)
        "response": response,
        "ground_truth": item.ground_truth,
        "score": None if score is None else float(score),
        "reward_model_score": None,
    }


def _reward_model_scores(c: Validated, answered: _Answered) -> list[float]:
    """The reward model's scores (as the reward uses them) of this rank's answers (one
    scoring pass per rank)."""
    t = trajectories(
        [i.prompt_ids for i in answered.items],
        RolloutBatch(answered.samples, policy_version=0),
        pad_token_id=c.tokenizer.pad_token_id,
        response_length=c.plan.response_length,
        device=default_device(),
    )
    raw = c.reward_model.scoring(t, c.budgets, 0, answered.items)
    return c.reward_model.score(raw, t).tolist()


def _first_rows(c: Validated, rows: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The first ``n`` rows of every rank's, in validation-set order, prompts decoded."""
    if n <= 0:
        return []
    every = concat_over_ranks({"rows": rows})["rows"]
    first = sorted(every, key=lambda r: r["position"])[:n]
    return [_readable(c, r) for r in first]


def _readable(c: Validated, row: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in row.items() if k not in ("position", "prompt_ids")}
    prompt = c.tokenizer.decode(list(row["prompt_ids"]), skip_special_tokens=True)
    return {"data_source": out.pop("data_source"), "prompt": prompt, **out}
