"""DAPO's dynamic sampling (``algorithm.filter_groups``): the filter's pieces by hand, then the
rollout source on a real (tiny) policy and HF engine: a first batch whose groups all score
alike is replaced by later ones, the step trains on exactly the batch size in prompts, and a
limit of generation batches stops the run with its reason."""

from __future__ import annotations

import zlib

import pytest
import torch
from test_step import components

from klppo_train.checks.validate import validate_config
from klppo_train.config.data import DataConfig
from klppo_train.config.errors import UserError
from klppo_train.config.schema import load_config
from klppo_train.data.datasets import PromptDataset
from klppo_train.demo.embedded import build_tokenizer
from klppo_train.demo.tasks import make_arithmetic_rows
from klppo_train.ppo.dynamic_sampling import varied_groups
from klppo_train.ppo.step import ppo_step, rule_scores, train_on
from klppo_train.trainer.assemble import StepBuilder

GRPO = (
    "algorithm.adv_estimator=grpo",
    "critic.enable=false",
    "algorithm.use_kl_in_reward=false",
    "rollout.n=4",
    "algorithm.filter_groups.enable=true",
)


def test_varied_groups_by_hand() -> None:
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])  # constant, varied, constant, single
    assert varied_groups(values, groups).tolist() == [F, F, T, T, F, F, T]
    shuffled = torch.tensor([5, 9, 5, 9])  # ids need not be 0..G-1 or contiguous
    assert varied_groups(torch.tensor([0.0, 1.0, 0.0, 2.0]), shuffled).tolist() == [F, T, F, T]


F, T = False, True


def _reward(constant: set[str]):
    """Right (1.0) for every sample of a prompt in ``constant``; else a coin from the text."""

    def score(data_source, solution_str, ground_truth, extra_info) -> float:
        if str(ground_truth) in constant:
            return 1.0
        return float(zlib.crc32(solution_str.encode()) % 2)

    return score


everything = PromptDataset(make_arithmetic_rows(40, seed=0), build_tokenizer(), DataConfig()).items


def _source(extra: tuple[str, ...] = ()):
    tokenizer = build_tokenizer()
    cfg, c = components(tokenizer, (*GRPO, *extra))
    items = everything
    batches = iter([items[i : i + 4] for i in range(4, 40, 4)])
    c.rewards.custom = _reward({str(i.ground_truth) for i in items[:4]})
    c.rollouts = StepBuilder(cfg).sampled_prompts(c, lambda: next(batches))
    return c, items[:4]


def test_a_batch_of_constant_groups_is_replaced_by_later_prompts() -> None:
    c, first = _source()
    collected = c.rollouts.collect(first, step=1)
    t, rule, items = collected.trajectories, collected.rule, collected.items
    m = collected.metrics
    assert m["train/num_gen_batches"] >= 2 and m["train/dropped_groups"] >= 4
    assert m["train/kept_groups"] >= 4
    groups = torch.unique(t.prompt_index)
    assert len(groups) == 4  # exactly the batch size in prompts
    assert not {id(items[int(g)]) for g in groups} & {id(i) for i in first}
    assert varied_groups(rule, t.prompt_index).all()  # every kept group varies
    assert torch.equal(rule, rule_scores(c.tokenizer, c.rewards, items, t))  # the rows' own
    for row in range(len(t.prompt_index)):  # each row answers the prompt it points to
        prompt = t.input_ids[row, : -t.response_length][
            t.attention_mask[row, : -t.response_length].bool()
        ]
        assert prompt.tolist() == list(items[int(t.prompt_index[row])].prompt_ids)
    assert (t.response_mask.sum(1) > 0).all() and (t.sample_versions == 0).all()
    # their places in the step: generation order (verl's batch[:size]), 0..3
    order = {id(item): i for i, item in enumerate(everything)}
    place = {
        int(p): order[id(items[int(g)])]
        for p, g in zip(t.prompt_position, t.prompt_index, strict=True)
    }
    assert sorted(place) == [0, 1, 2, 3] and [place[k] for k in range(4)] == sorted(place.values())
    metrics = train_on(c, items, t, step=1, rule=rule)
    assert metrics["critic/score/mean"] == pytest.approx(float(rule.mean()), abs=1e-6)


def test_gen_batch_size_rounds_are_larger_than_the_batch() -> None:
    """verl's data.gen_batch_size=8 with data.train_batch_size=4: the first round holds the
    4 constant prompts and 4 more, and its first 4 varied groups (generation order) fill
    the step in one round, where rounds of 4 needed at least two (the test above)."""
    tokenizer = build_tokenizer()
    cfg, c = components(tokenizer, (*GRPO, "data.gen_batch_size=8"))
    assert cfg.data.loader_batch_size == 8 and cfg.data.train_batch_size == 4
    rounds = iter([everything[i : i + 8] for i in range(8, 40, 8)])
    c.rewards.custom = _reward({str(i.ground_truth) for i in everything[:4]})
    c.rollouts = StepBuilder(cfg).sampled_prompts(c, lambda: next(rounds))
    collected = c.rollouts.collect(everything[:8], step=1)
    m, t, items = collected.metrics, collected.trajectories, collected.items
    assert len(torch.unique(t.prompt_index)) == 4  # train_batch_size prompts, not 8
    kept = {id(items[int(g)]) for g in torch.unique(t.prompt_index)}
    order = {id(item): i for i, item in enumerate(everything)}
    assert m["train/dropped_groups"] >= 4 and not kept & {id(i) for i in everything[:4]}
    if m["train/num_gen_batches"] == 1:  # all four others varied: exactly those four
        assert sorted(order[k] for k in kept) == [4, 5, 6, 7]
    else:  # a coin came up alike for one group: the next round of 8 completed the batch
        assert m["train/kept_groups"] >= 4 and min(order[k] for k in kept) >= 4


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["data.gen_batch_size=16"], "gen_batch_size=16 takes effect only with .*filter_groups"),
        ([*GRPO, "data.gen_batch_size=0"], "gen_batch_size must be an int >= 1"),
    ],
)
def test_bad_gen_batch_size_fails_before_any_model(extra: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_config(load_config(None, ["rollout.n=2", *extra]))


def test_the_step_reports_its_generation_batches() -> None:
    c, first = _source()
    metrics = ppo_step(c, first, step=1)
    assert metrics["train/num_gen_batches"] >= 2
    assert metrics["actor/pg_loss"] == metrics["actor/pg_loss"]  # finite, not NaN


def test_the_limit_of_generation_batches_stops_with_the_reason() -> None:
    c, first = _source(("algorithm.filter_groups.max_num_gen_batches=1",))
    with pytest.raises(UserError, match=r"0 of 4 prompts .* after 1 generation batches"):
        c.rollouts.collect(first, step=1)


FG = "algorithm.filter_groups."


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            [f"{FG}metric=seq_final_reward"],
            r"seq_final_reward is not run by klppo: .* \(use seq_reward\)",
        ),
        ([f"{FG}metric=accuracy"], r"metric='accuracy'; valid: acc, score, seq_reward"),
        ([f"{FG}max_num_gen_batches=-1"], "max_num_gen_batches must be >= 0"),
        ([f"{FG}metric=score"], r"metric takes effect only with .*enable=true"),
        ([f"{FG}enable=true", "rollout.n=1"], "rollout.n=1: a group of one sample is always kept"),
        (
            [f"{FG}enable=true", "rollout.n=2", "reward_model.enable=true", "reward_model.path=rm"],
            "enable=true with reward_model.combine=rm: .*filtered on the rule reward",
        ),
    ],
)
def test_bad_filter_keys_fail_before_any_model(extra: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_config(load_config(None, extra))


def test_a_run_in_epochs_is_told_what_dynamic_sampling_does_to_them() -> None:
    on = [f"{FG}enable=true", "algorithm.adv_estimator=grpo", "critic.enable=false", "rollout.n=2"]
    advice = validate_config(load_config(None, [*on, "trainer.total_training_steps=0"]))
    assert any("sees the data more often than total_epochs says" in a for a in advice)
    assert not validate_config(load_config(None, [*on, "trainer.total_training_steps=5"]))
