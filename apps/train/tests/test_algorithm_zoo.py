"""verl's policy losses and advantage estimators in real steps (``actor.policy_loss.loss_mode``,
``algorithm.adv_estimator``; single process, HF engine, the tiny embedded model): each runs two
PPO steps by verl's key names, each loss mode's keys change the step, and bad combinations
fail before any model loads."""

import copy
import functools
import math
import zlib

import pytest
import torch
from test_step import components

from klppo_train.checks.validate import validate_config
from klppo_train.config.choices import ADV_ESTIMATORS
from klppo_train.config.data import DataConfig
from klppo_train.config.schema import load_config
from klppo_train.data.datasets import PromptDataset
from klppo_train.demo.embedded import build_tokenizer
from klppo_train.demo.tasks import make_arithmetic_rows
from klppo_train.ppo.step import (
    Timings,
    _advantages,
    _forward_passes,
    _reward_model_scores,
    ppo_step,
    rule_scores,
    train_on,
)
from klppo_train.trainer.assemble import StepBuilder
from ppo_core import POLICY_LOSS_MODES, compute_optimal_token_baseline_advantages

VERL = "actor_rollout_ref.actor."
# two mini-batches: the second one is off-policy (ratio ≠ 1), where the modes differ most
OFF_POLICY = ["actor.ppo_mini_batch_size=2", "algorithm.use_kl_in_reward=false"]


def steps(extra: list[str], count: int = 1) -> list[dict]:
    return _steps(tuple(extra), count)


@functools.cache  # the same seeded steps serve several tests (the vanilla and base runs)
def _steps(extra: tuple[str, ...], count: int) -> list[dict]:
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    cfg, c = components(tokenizer, tuple([*OFF_POLICY, *extra]))
    items = PromptDataset(
        make_arithmetic_rows(4, seed=0), tokenizer, DataConfig(max_prompt_length=64)
    ).items
    c.rollouts = StepBuilder(cfg).sampled_prompts(c, lambda: items)  # as PPOTask builds it
    return [ppo_step(c, items, step=k + 1) for k in range(count)]


def mode_args(mode: str) -> list[str]:
    if mode == "bypass_mode":  # verl's apply_bypass_mode sets the loss mode from this key
        return ["algorithm.rollout_correction.bypass_mode=true"]
    return [f"{VERL}policy_loss.loss_mode={mode}"]


@pytest.mark.parametrize("mode", POLICY_LOSS_MODES)
def test_every_mode_runs_two_steps_by_verls_names(mode: str) -> None:
    first, second = steps(mode_args(mode), count=2)
    for metrics in (first, second):
        assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0
    if mode == "bypass_mode":  # π_old is the engine's: no old-log-prob pass
        assert "timing_s/old_log_prob" not in first
        assert "timing_s/old_log_prob" in steps(mode_args("vanilla"))[0]
    # clip_cov at verl's defaults cuts only tokens whose covariance is in (1, 5): none on this
    # tiny model, so it is the vanilla loss (its keys are tested below)
    if mode not in ("vanilla", "clip_cov", "bypass_mode"):
        vanilla = steps(mode_args("vanilla"))[0]
        assert first["actor/pg_loss"] != pytest.approx(vanilla["actor/pg_loss"], rel=1e-4)


def _moved(mode: str, key: str, value: str, metric: str = "actor/pg_loss") -> None:
    base = steps(mode_args(mode))[0]
    changed = steps([*mode_args(mode), f"{key}={value}"])[0]
    assert changed[metric] != pytest.approx(base[metric], rel=1e-6), (mode, key)


@pytest.mark.parametrize(
    ("mode", "key", "value"),
    [
        ("sapo", f"{VERL}tau_pos", "3.0"),
        ("sapo", f"{VERL}tau_neg", "3.0"),
        ("gspo", f"{VERL}clip_ratio", "0.0001"),  # verl's: both bounds
        ("geo_mean", "actor.clip_ratio_high", "0.001"),
        ("cispo", "actor.clip_ratio_low", "0.001"),
        ("kl_cov", f"{VERL}policy_loss.kl_cov_ratio", "0.5"),
        ("kl_cov", f"{VERL}policy_loss.ppo_kl_coef", "50"),
    ],
)
def test_each_modes_keys_change_the_step(mode: str, key: str, value: str) -> None:
    _moved(mode, key, value)


def test_clip_cov_keys_change_which_tokens_are_cut() -> None:
    """Clip-Cov cuts tokens with lb < cov < ub: a wide window and a large ratio cut some; the
    ratio, and each bound closing the window, change how many."""
    key = f"{VERL}policy_loss."
    wide = [*mode_args("clip_cov"), f"{key}clip_cov_lb=-100", f"{key}clip_cov_ub=100"]
    cut = steps([*wide, f"{key}clip_cov_ratio=0.5"])[0]["actor/pg_clipfrac"]
    assert 0.2 < cut <= 0.5
    assert steps([*wide, f"{key}clip_cov_ratio=0.1"])[0]["actor/pg_clipfrac"] < cut
    closed_lb = [*wide, f"{key}clip_cov_ratio=0.5", f"{key}clip_cov_lb=99"]
    closed_ub = [*wide, f"{key}clip_cov_ratio=0.5", f"{key}clip_cov_ub=-99"]
    assert steps(closed_lb)[0]["actor/pg_clipfrac"] == 0.0
    assert steps(closed_ub)[0]["actor/pg_clipfrac"] == 0.0


def test_gspo_aggregates_by_sequence_whatever_loss_agg_mode_says() -> None:
    """As verl: GSPO's policy loss is seq-mean-token-mean even under token-mean."""
    token = steps([*mode_args("gspo"), "actor.loss_agg_mode=token-mean"])[0]
    seq = steps([*mode_args("gspo"), "actor.loss_agg_mode=seq-mean-token-mean"])[0]
    assert token["actor/pg_loss"] == seq["actor/pg_loss"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([f"{VERL}policy_loss.loss_mode=ppo"], "actor.policy_loss.loss_mode.*vanilla"),
        ([f"{VERL}tau_pos=2"], "actor.tau_pos=2.0 takes no effect with .*loss_mode=vanilla"),
        (
            [f"{VERL}policy_loss.loss_mode=gspo", "actor.clip_ratio_c=10"],
            "actor.clip_ratio_c=10.0 takes no effect with .*=gspo",
        ),
        (
            [f"{VERL}policy_loss.loss_mode=sapo", f"{VERL}policy_loss.clip_cov_ratio=0.1"],
            "actor.policy_loss.clip_cov_ratio=0.1 takes no effect",
        ),
        ([f"{VERL}policy_loss.loss_mode=bypass_mode"], "set .*bypass_mode=true instead"),
        (
            [f"{VERL}policy_loss.loss_mode=gspo", "algorithm.rollout_correction.bypass_mode=true"],
            "bypass mode has its own loss",
        ),
    ],
)
def test_bad_combinations_fail_before_any_model(extra: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_config(load_config(None, extra))


CRITIC_FREE = [e for e in ADV_ESTIMATORS if e != "gae"]


@pytest.mark.parametrize("estimator", CRITIC_FREE)
def test_every_estimator_runs_two_steps_by_verls_names(estimator: str) -> None:
    extra = [f"algorithm.adv_estimator={estimator}", "critic.enable=false"]
    first, second = steps(extra, count=2)
    for metrics in (first, second):
        assert math.isfinite(metrics["actor/pg_loss"])
        assert math.isfinite(metrics["critic/advantages/mean"])


def test_the_estimators_give_their_own_advantages() -> None:
    """The same samples (seeded) scored by a random reward model (the rule scores the tiny
    model's answers all 0): the advantages differ between the estimators, and the vectorized
    twins equal their originals."""
    rm = ["reward_model.enable=true", "reward_model.path=rm", "critic.enable=false"]
    got = {
        e: steps([*rm, f"algorithm.adv_estimator={e}"])[0]["critic/advantages/max"]
        for e in CRITIC_FREE
        if e != "remax"  # its baseline is the rule's (refused with a reward model: below)
    }
    assert got["grpo_vectorized"] == got["grpo"] and got["rloo_vectorized"] == got["rloo"]
    distinct = {round(got[e], 6) for e in ("grpo", "grpo_passk", "rloo", "gpg")}
    assert len(distinct) == 4, got
    # every response is 4 tokens long and no score is 0: OPO's length-weighted mean is the
    # plain mean and GPG's α = B/#nonzero is 1, so the two coincide (two samples a prompt:
    # half the gap), and RLOO's leave-one-out baseline gives the whole gap
    assert got["opo"] == pytest.approx(got["gpg"]) == pytest.approx(got["rloo"] / 2)


ON_POLICY = ("actor.ppo_mini_batch_size=4", "critic.enable=false")  # the shortcut's set-up
RANDOM_RM = ("reward_model.enable=true", "reward_model.path=rm")  # scores that differ


def _plain_forward(model, t, temperature: float):
    """log π and Σπ² of each response token from a whole-sequence forward of each sample
    alone, padding dropped (sdpa attention: not the trainer's packed path), ``[N, T]``."""
    model = copy.deepcopy(model)
    model.set_attn_implementation("sdpa")
    T = t.response_length
    logp, spp = torch.zeros(t.response_mask.shape), torch.zeros(t.response_mask.shape)
    with torch.no_grad():
        for i in range(t.input_ids.shape[0]):
            keep = t.attention_mask[i].bool()
            ids = t.input_ids[i][keep]
            r = int(t.response_mask[i].sum())
            p = ids.shape[0] - r
            probs = torch.softmax(model(ids[None]).logits[0].double() / temperature, -1)
            at = probs[p - 1 : p + r - 1]
            logp[i, :r] = at.gather(-1, ids[p:, None]).squeeze(-1).log().float()
            spp[i, :r] = at.square().sum(-1).float()
    assert t.response_mask.shape[1] == T
    return logp, spp


def test_optimal_token_baseline_reads_the_old_passes_sum_pi_squared() -> None:
    """One mini-batch and no KL in the reward would skip the old-log-prob pass (the
    on-policy shortcut); the optimal token baseline runs it, and its Σπ² and log π_old
    equal a plain forward's (1e-5); the step's advantages are ppo_core's on those inputs
    and the rewards, and actor/sum_pi_squared their mean over the loss tokens."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    extra = (*ON_POLICY, *RANDOM_RM, "algorithm.adv_estimator=optimal_token_baseline")
    cfg, c = components(tokenizer, (*OFF_POLICY, *extra))
    assert not c.on_policy_shortcut and c.old_log_prob.with_sum_pi_squared
    items = PromptDataset(
        make_arithmetic_rows(4, seed=0), tokenizer, DataConfig(max_prompt_length=64)
    ).items
    t = c.rollouts.collect(items, 1).trajectories
    passed = _forward_passes(c, t, 1, Timings())
    logp, spp = _plain_forward(c.actor.model, t, cfg.rollout.sampling.temperature)
    mask = t.loss_mask.bool()
    torch.testing.assert_close(passed.sum_pi_squared[mask], spp[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(passed.old_logprobs[mask], logp[mask], rtol=0, atol=1e-5)
    rm_raw = _reward_model_scores(c, items, passed, 1, Timings())
    scored, scores, _ = _advantages(c, items, passed, rm_raw, None)
    want, _ = compute_optimal_token_baseline_advantages(scores, t.prompt_index, t.loss_mask,
                                                        logp, spp)  # fmt: skip
    torch.testing.assert_close(scored.advantages, want, rtol=0, atol=1e-4)
    assert scored.advantages[mask].abs().sum() > 0
    metrics = train_on(c, items, t, 1)
    assert "timing_s/old_log_prob" in metrics
    assert metrics["actor/sum_pi_squared"] == pytest.approx(float(spp[mask].mean()), abs=1e-5)


def test_calculate_sum_pi_squared_takes_effect_with_any_estimator() -> None:
    """verl's actor.calculate_sum_pi_squared with GRPO: the old pass runs on the on-policy
    set-up and logs Σπ²; without it the shortcut skips the pass and there is none."""
    grpo = [*ON_POLICY, "algorithm.adv_estimator=grpo"]
    on = steps([*grpo, f"{VERL}calculate_sum_pi_squared=true"])[0]
    off = steps(grpo)[0]
    assert 0 < on["actor/sum_pi_squared"] <= 1 and "timing_s/old_log_prob" in on
    assert "actor/sum_pi_squared" not in off and "timing_s/old_log_prob" not in off
    assert off["actor/on_policy_shortcut"] == 1.0 and on["actor/on_policy_shortcut"] == 0.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["algorithm.adv_estimator=optimal_token_baseline",
             "algorithm.rollout_correction.bypass_mode=true"],
            "adv_estimator=optimal_token_baseline needs Σπ² from the old-log-prob pass, which "
            "algorithm.rollout_correction.bypass_mode skips",
        ),
        (
            [f"{VERL}calculate_sum_pi_squared=true",
             "algorithm.rollout_correction.bypass_mode=true"],
            "actor.calculate_sum_pi_squared needs Σπ²",
        ),
        (
            ["algorithm.adv_estimator=tir_optimal_token_baseline", "rollout.n=1"],
            "is a baseline over a prompt's samples: rollout.n must be >= 2, got 1",
        ),
    ],
)  # fmt: skip
def test_token_baseline_combinations_fail_before_any_model(extra, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_config(load_config(None, ["critic.enable=false", *extra]))


OVERLONG = "reward_model.reward_kwargs.overlong_buffer_cfg."  # verl's DAPO recipes' keys


def test_overlong_penalty_by_verls_keys() -> None:
    """Responses of 4 tokens (the limit: the random tiny model never stops), buffer 2,
    factor 0.5: each loses 0.5·(4 − 2)/2 = 0.5; the same seeded samples otherwise."""
    plain = steps([])[0]
    keys = [f"{OVERLONG}enable=true", f"{OVERLONG}len=2", f"{OVERLONG}penalty_factor=0.5"]
    shaped = steps([*keys, f"{OVERLONG}log=true"])[0]
    assert plain["response_length/mean"] == shaped["response_length/mean"] == 4.0
    assert shaped["reward/overlong_penalty/mean"] == pytest.approx(-0.5)
    assert shaped["reward/overlong_fraction"] == 1.0
    assert shaped["critic/score/mean"] == pytest.approx(plain["critic/score/mean"] - 0.5)
    assert "reward/overlong_fraction" not in steps(keys)[0]  # log=false: the penalty, no metrics


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([f"{OVERLONG}len=2"], "overlong_buffer.len takes effect only with .*enable=true"),
        ([f"{OVERLONG}enable=true", f"{OVERLONG}len=5"], "len=5: want 0 < len <= .*=4"),
        ([f"{OVERLONG}enable=true"], "len=0"),
    ],
)
def test_bad_overlong_keys_fail_before_any_model(extra: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_config(load_config(None, ["rollout.response_length=4", *extra]))


def test_remax_baselines_are_the_greedy_answers_rewards() -> None:
    """Each sample's baseline is the rule reward of the greedy answer to its prompt (generated
    again here, independently), and A_t = G_t − b at every response token."""
    tokenizer = build_tokenizer()
    extra = ("algorithm.adv_estimator=remax", "critic.enable=false", *OFF_POLICY)
    cfg, c = components(tokenizer, extra)
    c.rewards.custom = lambda source, text, truth, info: float(zlib.crc32(text.encode()) % 3)
    items = PromptDataset(make_arithmetic_rows(4, seed=0), tokenizer, DataConfig()).items
    c.rollouts = StepBuilder(cfg).sampled_prompts(c, lambda: items)
    collected = c.rollouts.collect(items, step=1)
    t, baselines = collected.trajectories, collected.baselines
    greedy = c.engine.generate([list(i.prompt_ids) for i in items], c.plan.sampling.for_baseline(1))
    answers = {s.prompt_index: tokenizer.decode(s.response_token_ids, skip_special_tokens=True)
               for s in greedy.samples}  # fmt: skip
    want = [float(zlib.crc32(answers[int(i)].encode()) % 3) for i in t.prompt_index]
    assert baselines.tolist() == want and len(set(want)) > 1
    assert collected.metrics["reward/greedy_baseline/mean"] == pytest.approx(
        sum(want[::2]) / 4  # two samples a prompt, in prompt order
    )
    scores = rule_scores(tokenizer, c.rewards, collected.items, t)
    metrics = train_on(c, collected.items, t, step=1, baselines=baselines)
    lengths = t.loss_mask.sum(1).double()
    mean = float(((scores.double() - baselines.double()) * lengths).sum() / lengths.sum())
    assert metrics["critic/advantages/mean"] == pytest.approx(mean, abs=1e-6)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["algorithm.filter_groups.enable=true", "rollout.n=2"],
            "remax with algorithm.filter_groups",
        ),
        (
            ["reward_model.enable=true", "reward_model.path=rm"],
            "remax with reward_model.combine=rm: .* scored by the rule reward",
        ),
    ],
)
def test_remax_combinations_it_cannot_run_fail_before_any_model(extra, message) -> None:
    with pytest.raises(ValueError, match=message):
        validate_config(load_config(None, ["algorithm.adv_estimator=remax", *extra]))
