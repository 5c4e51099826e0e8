"""``async_training``: rollouts generated s steps ahead of the update that trains them, on a
real (tiny) policy and HF engine. Every trained sample's version is checked against the
schedule (k − 1 − s, the first steps' 0), the trained prompts are the loader's in order,
the on-policy shortcut never takes a stale sample, s = 0 is the synchronous step, a resumed
run trains the batches that were in flight, and bad combinations fail before any model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_run import assert_complete_run, overrides
from test_step import components

from klppo_train.__main__ import main
from klppo_train.checks.validate import validate_config
from klppo_train.config.async_training import AsyncTrainingConfig
from klppo_train.config.data import DataConfig
from klppo_train.config.errors import UserError
from klppo_train.config.schema import load_config
from klppo_train.data.datasets import PromptDataset
from klppo_train.demo.embedded import build_tokenizer
from klppo_train.demo.tasks import make_arithmetic_rows
from klppo_train.ppo.rollouts_ahead import RESUME_COLOCATED, NothingAhead, RolloutsAhead
from klppo_train.ppo.step import ppo_step, train_on
from klppo_train.trainer.assemble import StepBuilder

# one mini-batch, one epoch, no KL in the reward, no correction: the shortcut is allowed
ON_POLICY = (
    "algorithm.adv_estimator=grpo",
    "critic.enable=false",
    "algorithm.use_kl_in_reward=false",
    "actor.ppo_mini_batch_size=4",
    "algorithm.rollout_correction.rollout_is=null",
)
items = PromptDataset(make_arithmetic_rows(48, seed=0), build_tokenizer(), DataConfig()).items
batches = [items[i : i + 4] for i in range(0, 48, 4)]


def _ahead(extra: tuple[str, ...], last_step: int | None = None, start: int = 0):
    cfg, c = components(build_tokenizer(), extra)
    loader = iter(batches[start:])
    more = lambda: next(loader)  # noqa: E731
    c.rollouts = StepBuilder(cfg).sampled_prompts(c, more, last_step, dataset=items)
    return c, loader


def _s(s: int) -> tuple[str, ...]:
    return ("async_training.enable=true", f"async_training.max_staleness_steps={s}")


@pytest.mark.parametrize("s", [1, 2])
def test_every_trained_sample_is_as_old_as_the_schedule_says(s: int) -> None:
    assert components(build_tokenizer(), ON_POLICY)[1].on_policy_shortcut  # allowed here
    c, loader = _ahead((*ON_POLICY, *_s(s)))
    # ... but never with s > 0: π_old is recomputed on every step's samples
    assert isinstance(c.rollouts, RolloutsAhead) and not c.on_policy_shortcut
    for step in range(1, 6):
        collected = c.rollouts.collect(next(loader), step)
        t = collected.trajectories
        version = max(0, step - 1 - s)  # the first s steps': the starting weights
        assert t.sample_versions.tolist() == [version] * t.sample_versions.numel(), step
        trained = {i.index for i in collected.items}
        assert trained == {i.index for i in batches[step - 1]}  # the loader's, in order
        assert collected.metrics["async/staleness_max"] == step - 1 - version
        metrics = train_on(c, collected.items, t, step)
        assert metrics["actor/on_policy_shortcut"] == 0.0, step
        c.rollouts.publish(step)
    assert len(c.rollouts.ahead) == s  # in flight: the batches of steps 6 … 5+s


def test_a_resume_keeps_the_bound_and_the_batches_prompts() -> None:
    """Steps 1–3 at s = 2 leave steps 4 and 5 in flight: a source with s = 1 refuses them
    (they would train 2 versions old), one with s = 3 takes them (the prompts: the data
    set's own rows) and generates what it lacks; a synchronous run refuses them too."""
    c, loader = _ahead(_s(2))
    for step in range(1, 4):
        c.rollouts.collect(next(loader), step)
        c.rollouts.publish(step)
    state = c.rollouts.state_dict()
    assert [saved["step"] for saved in state["ranks"][0]] == [4, 5]
    with pytest.raises(UserError, match="max_staleness_steps=1: .* 2 batches generated ahead"):
        _ahead(_s(1))[0].rollouts.load_state_dict(state)
    with pytest.raises(UserError, match="resume it with async_training.enable=true"):
        NothingAhead().load_state_dict(state)
    with pytest.raises(UserError, match="regenerate .* async_training.rollout_ranks=0"):
        NothingAhead(RESUME_COLOCATED).load_state_dict(state)
    resumed, loader = _ahead(_s(3), start=5)  # the loader's position: 5 batches taken
    resumed.rollouts.load_state_dict(state)
    resumed.rollouts.resume(3)
    assert resumed.rollouts.ahead[0][1].items[0] is items[12]  # step 4's first prompt
    for step in range(4, 8):
        collected = resumed.rollouts.collect(next(loader), step)
        assert [i.index for i in collected.items] == [i.index for i in batches[step - 1]]
        age = collected.metrics["async/staleness_max"]
        assert age == {4: 2, 5: 2, 6: 2, 7: 3}[step], step  # 6, 7: generated at step 4
        resumed.rollouts.publish(step)
    with pytest.raises(UserError, match="generated ahead for 2 ranks"):
        resumed.rollouts.load_state_dict({**state, "world_size": 2, "dp_size": 2})
    NothingAhead().load_state_dict(NothingAhead().state_dict())  # nothing in flight: fine


def test_nothing_is_generated_past_the_last_step() -> None:
    c, loader = _ahead(("async_training.enable=true", "async_training.max_staleness_steps=2"), 3)
    generated, collect = [], c.rollouts.inner.collect

    def counted(batch, step):
        generated.append(step)
        return collect(batch, step)

    c.rollouts.inner.collect = counted
    sleeps, sleep = [], c.engine.sleep
    c.engine.sleep = lambda: sleeps.append(1) or sleep()
    for step in range(1, 4):
        assert {i.index for i in c.rollouts.collect(next(loader), step).items} == {
            i.index for i in batches[step - 1]
        }
        c.rollouts.publish(step)
    assert generated == [1, 2, 3] and not c.rollouts.ahead  # not steps 4 and 5
    assert len(sleeps) == 5  # after each of the 3 generations, and on steps 2 and 3


def test_no_lag_is_the_synchronous_step() -> None:
    """s = 0 runs the same calls with the same seeds: equal metrics, step by step."""
    runs = []
    for extra in [(), ("async_training.enable=true", "async_training.max_staleness_steps=0")]:
        torch.manual_seed(0)
        cfg, c = components(build_tokenizer(), extra)
        assert cfg.algorithm.rollout_correction.rollout_is is None  # auto: none at s = 0
        c.rollouts = StepBuilder(cfg).sampled_prompts(c, lambda: 1 / 0)  # never called
        runs.append([ppo_step(c, batches[k], k + 1) for k in range(3)])
    for a, b in zip(*runs, strict=True):
        keep = [k for k in a if not k.startswith(("timing_s/", "perf/"))]
        assert {k: a[k] for k in keep} == {k: b[k] for k in keep}
        assert b["async/staleness_max"] == 0.0 and "async/staleness_max" not in a


def test_a_resumed_run_trains_the_batches_in_flight(tmp_path: Path) -> None:
    """3 steps straight vs 2, stop, resume, 1 more at s = 1: the checkpoint of step 2 holds
    step 3's batch (generated by version 1), so step 3 is the same either way."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ["trainer.save_freq=2", "async_training.enable=true"]
    assert main([*overrides(straight, steps=3), *common]) == 0
    assert main([*overrides(resumed, steps=3), *common, "trainer.stop_at_step=2"]) == 0
    assert main([*overrides(resumed, steps=3), *common]) == 0
    a, b = assert_complete_run(straight, 3), assert_complete_run(resumed, 3)
    for x, y in zip(a, b, strict=True):
        keep = [k for k in x if not k.startswith(("timing_s/", "perf/"))]
        assert {k: x[k] for k in keep} == {k: y[k] for k in keep}, x["step"]
    assert a[3]["actor/policy_version_sampled"] == 1.0 and a[3]["async/staleness_max"] == 1.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["async_training.max_staleness_steps=2"], "takes effect only with async_training.enable"),
        (["async_training.enable=true", "async_training.max_staleness_steps=-1"], "int >= 0"),
        (
            ["async_training.enable=true", "algorithm.rollout_correction.bypass_mode=true"],
            "stale samples need π_old",
        ),
        (["async_training.enable=true", "rollout.vllm.sleep_level=2"], "sleep_level=1"),
        (["async_training.enable=true", "trainer.task=reward_model"], "trains PPO only"),
        (["async_training.enable=true", "trainer.val_only=true"], "only in training"),
        (["async_training.staleness_threshold=0.1"], "max_staleness_steps"),
        (["rollout.max_head_offpolicyness=2"], "AReaL's name"),
    ],
)
def test_bad_async_keys_fail_before_any_model(extra: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_config(load_config(None, extra))


RANKS = ("async_training.enable=true", "async_training.rollout_ranks=1")


@pytest.mark.parametrize(
    ("extra", "world", "message"),
    [
        (["async_training.rollout_ranks=1"], 2, "takes effect only with async_training.enable"),
        (["async_training.enable=true", "async_training.rollout_ranks=-1"], 2, "int >= 0"),
        (list(RANKS), 1, "leaves no training rank in the launch's world size 1"),
        (["async_training.enable=true", "async_training.rollout_ranks=2"], 2, "no training rank"),
        (["async_training.enable=true", "async_training.rollout_ranks=2"], 3, "one generating"),
        (["async_training.enable=true", "async_training.rollout_ranks=2"], 5, "as many of each"),
        ([*RANKS, "reward_model.enable=true", "reward_model.path=/x"], 2, "reward_model.enable"),
        ([*RANKS, "actor.ulysses_sequence_parallel_size=2"], 3, "ulysses_sequence_parallel"),
        # the checks after the split count the training ranks: 2 of 3, the batch of 8 splits
        ([*RANKS, "data.train_batch_size=7"], 3, "data.train_batch_size"),
    ],
)
def test_bad_rollout_ranks_fail_before_any_model(extra: list[str], world: int, message) -> None:
    with pytest.raises(ValueError, match=message):
        validate_config(load_config(None, extra), world)


def test_verl_names_its_rollout_pool() -> None:
    """verl's fully-async ``rollout.nnodes`` × ``rollout.n_gpus_per_node``: R."""
    verl = ["async_training.enable=true", "rollout.nnodes=1", "rollout.n_gpus_per_node=1"]
    assert load_config(None, verl).async_training.rollout_ranks == 1
    with pytest.raises(ValueError, match="rollout.nnodes=2: verl's generating ranks"):
        load_config(None, [*verl[:1], "rollout.nnodes=2"])
    two = load_config(None, [*verl[:1], "rollout.n_gpus_per_node=2"])
    validate_config(two, 4)  # 2 + 2
    with pytest.raises(ValueError, match="rollout_ranks=2 at world size 3: this version"):
        validate_config(two, 3)


def test_rollout_ranks_leave_the_training_ranks_to_the_other_checks() -> None:
    validate_config(load_config(None, list(RANKS)), 2)  # 1 + 1: the default fits
    validate_config(load_config(None, list(RANKS)), 3)  # 2 + 1
    two = ("async_training.enable=true", "async_training.rollout_ranks=2")
    validate_config(load_config(None, list(two)), 4)  # 2 + 2


def test_correction_is_token_tis_where_samples_lag() -> None:
    def rollout_is(*extra: str):
        return load_config(None, list(extra)).algorithm.rollout_correction.rollout_is

    assert rollout_is() is None
    assert rollout_is("async_training.enable=true") == "token"  # s = 1
    assert rollout_is("async_training.enable=true", "async_training.max_staleness_steps=0") is None
    off = "algorithm.rollout_correction.rollout_is=null"
    assert rollout_is("async_training.enable=true", off) is None  # the user's choice
    verl = load_config(None, ["async_training.staleness_threshold=0"])  # verl's default: taken
    assert verl.async_training == AsyncTrainingConfig()


def test_a_whole_batch_splits_over_training_ranks_in_whole_balanced_groups() -> None:
    """``shares``: what the generating rank sends each of two training ranks. Four prompts
    of 2 samples each, one prompt's answers much longer: every sample lands once, with its
    whole group, its prompt's position in the batch and its rule reward."""
    from klppo_train.ppo.rollout_ranks import shares
    from klppo_train.ppo.rollouts import Collected
    from klppo_train.workers.trajectories import Trajectories

    lengths = torch.tensor([9, 8, 2, 3, 2, 2, 3, 2])  # prompt 0 holds most of the tokens
    mask = (torch.arange(10) < lengths[:, None]).long()
    prompt = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    t = Trajectories(
        input_ids=torch.arange(80).reshape(8, 10), attention_mask=mask, response_mask=mask,
        engine_logprobs=-torch.rand(8, 10), prompt_index=prompt,
        sample_versions=torch.arange(8),
    )  # fmt: skip
    counts = {"rollout/generation_tokens": 31.0, "reward/errors": 2.0}  # summed over ranks
    c = Collected(["p0", "p1", "p2", "p3"], t, {"timing_s/gen": 1.0, **counts}, torch.arange(8.0))
    got = shares(c, 2)
    seen = torch.cat([s.trajectories.sample_versions for s in got]).sort().values
    assert seen.tolist() == list(range(8))  # each sample once
    for share in got:
        s = share.trajectories
        rows = s.sample_versions  # the row each sample was in the whole batch
        assert torch.equal(s.input_ids, t.input_ids[rows])
        assert torch.equal(share.rule, c.rule[rows])
        assert torch.equal(s.prompt_position, prompt[rows])  # its prompt's position
        assert [share.items[i] for i in s.prompt_index] == [f"p{p}" for p in prompt[rows]]
        assert share.metrics["timing_s/gen"] == 1.0
    for key, n in counts.items():  # counted once over the ranks
        assert sum(share.metrics.get(key, 0.0) for share in got) == n
    # balanced: the long prompt alone is worth three short ones; equal prompts per rank
    assert sorted(len(s.items) for s in got) == [2, 2]
    assert got[0].metrics["perf/dp_imbalance_after"] <= got[0].metrics["perf/dp_imbalance_before"]
    # trainer.balance_batch=false: equal runs of prompts, as two colocated ranks generate
    assert [s.items for s in shares(c, 2, balance=False)] == [["p0", "p1"], ["p2", "p3"]]


def test_only_a_link_failure_is_named_as_a_lost_rank() -> None:
    from klppo_train.ppo.rollout_ranks import named_link
    from klppo_train.runtime.process_group import LostRank

    gone = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:18077."
    who = "rank 1: the training rank (rank 0)"
    lost = pytest.raises(LostRank, match="rank 1: the training rank .rank 0. did not answer")
    with lost, named_link(who):
        raise RuntimeError(gone)
    oom = "CUDA out of memory. Tried to allocate 2.00 GiB"  # the generating rank's own fault
    with pytest.raises(RuntimeError, match="CUDA out of memory") as raised, named_link(who):
        raise RuntimeError(oom)
    assert not isinstance(raised.value, LostRank)
