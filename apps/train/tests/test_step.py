"""Two real PPO steps end to end (single process, HF engine, tiny embedded model)."""

import copy
import math
from dataclasses import replace

import torch
from transformers import Qwen2ForTokenClassification

from klppo_train.budgets.run_budgets import AUTO, budgets_from_config, configured
from klppo_train.checks.validate import validate_config
from klppo_train.config.data import DataConfig
from klppo_train.config.roles import run_roles
from klppo_train.config.schema import load_config
from klppo_train.data.datasets import PromptDataset
from klppo_train.data.rewards import RewardManager
from klppo_train.demo.embedded import build_model, build_tokenizer
from klppo_train.demo.tasks import make_arithmetic_rows
from klppo_train.ppo.step import ppo_step, train_on
from klppo_train.runtime.packed_attention import VARLEN
from klppo_train.trainer.assemble import StepBuilder
from klppo_train.workers.trainee import mini_batches
from rollout import HFEngine, HFEngineConfig, WeightSync

OVERRIDES = [
    "data.train_batch_size=4",
    "data.max_prompt_length=64",
    "rollout.n=2",
    "rollout.response_length=4",
    "rollout.engine=hf",
    "actor.ppo_mini_batch_size=2",
    "critic.ppo_mini_batch_size=2",
    "actor.ppo_max_token_len_per_gpu=256",
    "ref.log_prob_max_token_len_per_gpu=512",
    "critic.ppo_max_token_len_per_gpu=512",
    "actor.lr=1e-3",
    "critic.lr=1e-3",
    "actor.entropy_coeff=0.001",
    "actor.use_kl_loss=true",
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_ctrl.type=adaptive",
]


def scalar_head_model(actor, seed: int, bias: bool = True) -> Qwen2ForTokenClassification:
    """A one-label token classifier on a copy of ``actor``'s config (a critic; without
    ``bias``, a reward model's layout), its head and backbone drawn from ``seed``."""
    config = copy.deepcopy(actor.config)
    config.num_labels, config.classifier_dropout = 1, 0.0
    config.token_classification_bias = bias
    torch.manual_seed(seed)
    return Qwen2ForTokenClassification(config)


def components(tokenizer, extra: tuple[str, ...] = ()) -> tuple:
    """``(cfg, Components)`` around plain (unsharded) tiny models, built by the trainer's
    own :class:`klppo_train.trainer.assemble.StepBuilder` from the config with ``extra``
    overrides (``reward_model.enable=true``: a random reward model too, and one more per
    ``reward_model.ensemble.paths`` entry, each drawn from its own seed)."""
    actor = build_model(len(tokenizer), seed=0, hidden=64)
    critic = scalar_head_model(actor, seed=1)
    cfg = load_config(None, [*OVERRIDES, *extra])
    rm = scalar_head_model(actor, seed=2, bias=False) if cfg.reward_model.enable else None
    members = [
        scalar_head_model(actor, seed=10 + i, bias=False).eval()
        for i, _ in enumerate(cfg.reward_model.ensemble.paths)
    ]
    for model in (
        actor,
        critic,
        rm,
        *members,
    ):  # as the trainer builds them (share_prompts needs it)
        if model is not None:
            model.set_attn_implementation(VARLEN)
    validate_config(cfg)
    engine = HFEngine(copy.deepcopy(actor), HFEngineConfig(pad_token_id=0, eos_token_ids=(1,)))
    c = StepBuilder(cfg).components(
        actor=actor,
        engine=engine,
        weight_sync=WeightSync(actor.named_parameters, engine),
        tokenizer=tokenizer,
        rewards=RewardManager(),
        ref=copy.deepcopy(actor).eval(),
        critic=critic,
        reward_model=rm.eval() if rm is not None else None,
        ensemble=members,
        rm_tokenizer=tokenizer,
    )
    if not any(configured(cfg, role) == AUTO for role in run_roles(cfg)):  # else the probe's
        c.budgets = budgets_from_config(cfg)
    return cfg, c


def test_two_ppo_steps() -> None:
    tokenizer = build_tokenizer()
    _, c = components(tokenizer)
    items = PromptDataset(
        make_arithmetic_rows(4, seed=0), tokenizer, DataConfig(max_prompt_length=64)
    ).items
    before = [p.detach().clone() for p in c.actor.model.parameters()]
    first = ppo_step(c, items, step=1)
    second = ppo_step(c, items, step=2)
    for metrics in (first, second):
        for name in (
            "actor/pg_loss",
            "actor/pg_clipfrac",
            "actor/ppo_kl",
            "actor/entropy",
            "actor/kl_loss",
            "actor/grad_norm",
            "critic/vf_loss",
            "critic/score/mean",
            "critic/advantages/mean",
            "response_length/mean",
            "actor/reward_kl_penalty",
            "actor/reward_kl_penalty_coeff",
            "rollout/logprob_diff_mean",
            "timing_s/gen",
            "timing_s/update_actor",
            "timing_s/update_weights",
            "timing_s/step",
            "perf/throughput",
            "critic/vf_explained_var",
        ):
            assert math.isfinite(metrics[name]), name
    # the engine generated step 2 with the weights synced at the end of step 1 ...
    assert first["actor/policy_version_sampled"] == 0
    assert second["actor/policy_version_sampled"] == 1 and c.engine.policy_version == 2
    # ... and those are exactly the trainer's: old log-probs equal the engine's (same weights)
    assert second["rollout/logprob_diff_max"] < 1e-4
    assert any(
        not torch.equal(a, b) for a, b in zip(before, c.actor.model.parameters(), strict=True)
    )


def _count_forwards(model, grad: bool = False) -> list[int]:
    """Calls of ``model`` with autograd off (a log-prob or value pass: one per micro-batch),
    or with ``grad=True`` on (an update: one per micro-batch)."""
    calls = [0]

    def hook(module, args, kwargs):
        if torch.is_grad_enabled() == grad:
            calls[0] += 1

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


def _step_with(extra: list[str], counted: str = "actor", grad: bool = False):
    tokenizer = build_tokenizer()
    _, c = components(tokenizer, tuple(extra))
    items = PromptDataset(
        make_arithmetic_rows(4, seed=0), tokenizer, DataConfig(max_prompt_length=64)
    ).items
    model = {"actor": c.actor.model, "critic": c.critic.model, "ref": c.ref.model}[counted]
    calls = _count_forwards(model, grad)
    return ppo_step(c, items, step=1), calls[0]


def test_old_log_prob_pass_uses_the_rollout_budget() -> None:
    # 8 sequences of > 34 tokens: a 1024-token budget packs them into one micro-batch, 68
    # (prompt + response length) one per micro-batch; the reference's budget stays 512.
    _, one = _step_with(["rollout.log_prob_max_token_len_per_gpu=1024"])
    _, many = _step_with(["rollout.log_prob_max_token_len_per_gpu=68"])
    assert (one, many) == (1, 8)


def test_on_policy_step_skips_the_old_log_prob_pass() -> None:
    on_policy = ["actor.ppo_mini_batch_size=4", "algorithm.use_kl_in_reward=false"]
    metrics, calls = _step_with(on_policy)
    assert calls == 0 and "timing_s/old_log_prob" not in metrics
    assert metrics["actor/on_policy_shortcut"] == 1.0
    # logπ_old = sg(logπ): the ratio is exactly 1, nothing is clipped
    assert metrics["actor/ppo_kl"] == 0.0 and metrics["actor/pg_clipfrac"] == 0.0
    # the mismatch and the entropy come from the update's forward instead (same weights)
    assert metrics["rollout/logprob_diff_max"] < 1e-4
    assert math.isfinite(metrics["actor/entropy"]) and metrics["actor/entropy"] > 0
    # two mini-batches: the pass runs (once: one micro-batch at this budget)
    metrics, calls = _step_with(["algorithm.use_kl_in_reward=false"])
    assert calls == 1 and metrics["actor/on_policy_shortcut"] == 0.0


def test_train_on_takes_trajectories_without_an_engine_and_checks_their_versions() -> None:
    """``train_on`` trains on trajectories alone (no engine, no weight sync); the on-policy
    shortcut is taken only for samples of the weights being trained (version step - 1)."""
    on_policy = ("actor.ppo_mini_batch_size=4", "algorithm.use_kl_in_reward=false")
    tokenizer = build_tokenizer()
    _, c = components(tokenizer, on_policy)
    items = PromptDataset(
        make_arithmetic_rows(4, seed=0), tokenizer, DataConfig(max_prompt_length=64)
    ).items
    collected = c.rollouts.collect(items, step=1)  # the engine holds version 0
    mine, t = collected.items, collected.trajectories
    assert t.sample_versions.tolist() == [0] * 8
    c.engine = c.weight_sync = c.rollouts = None  # nothing to generate or sync with
    calls = _count_forwards(c.actor.model)
    fresh = train_on(c, mine, t, step=1)  # trains version 0 into 1
    assert calls[0] == 0 and fresh["actor/on_policy_shortcut"] == 1.0
    assert "timing_s/old_log_prob" not in fresh
    # the same samples as update 2: the trainer holds version 1, they are of version 0
    stale = train_on(c, mine, t, step=2)
    assert calls[0] == 1 and stale["actor/on_policy_shortcut"] == 0.0
    assert stale["rollout/logprob_diff_max"] > fresh["rollout/logprob_diff_max"]
    # one sample of an older version among current ones is enough to refuse it
    older = torch.tensor([2] * 7 + [1])
    mixed = train_on(c, mine, replace(t, sample_versions=older, policy_version=1), step=3)
    assert calls[0] == 2 and mixed["actor/on_policy_shortcut"] == 0.0
    now = torch.full((8,), 3)
    current = train_on(c, mine, replace(t, sample_versions=now, policy_version=3), step=4)
    assert calls[0] == 2 and current["actor/on_policy_shortcut"] == 1.0


def test_shared_prompts_run_fewer_tokens_for_the_same_step() -> None:
    """``model.share_prompts``: the same step (same samples, losses, KL, gradients) with each
    prompt's tokens run once for its two samples in every pass of the actor."""
    runs = {}
    for share in ("true", "false"):
        tokenizer = build_tokenizer()
        _, c = components(tokenizer, (f"model.share_prompts={share}",))
        items = PromptDataset(
            make_arithmetic_rows(4, seed=0), tokenizer, DataConfig(max_prompt_length=64)
        ).items
        embedded = [0]
        c.actor.model.get_input_embeddings().register_forward_hook(
            lambda module, args, out, n=embedded: n.__setitem__(0, n[0] + args[0].numel())
        )
        runs[share] = (ppo_step(c, items, step=1), embedded[0])
    (shared, shared_tokens), (plain, plain_tokens) = runs["true"], runs["false"]
    assert shared_tokens < 0.75 * plain_tokens  # ~30-token prompts, 4-token responses
    for name in ("actor/pg_loss", "actor/ppo_kl", "actor/grad_norm", "critic/vf_loss"):
        assert math.isclose(shared[name], plain[name], rel_tol=1e-4, abs_tol=1e-6), name
    assert shared["response_length/mean"] == plain["response_length/mean"]


def test_mini_batches_hold_whole_prompts_in_a_seeded_order() -> None:
    prompts = torch.tensor([1, 1, 0, 0, 3, 3, 2, 2])  # rows of 4 prompts, n = 2
    batches = mini_batches(prompts, 2, seed=0)
    assert sorted(torch.cat(batches).tolist()) == list(range(8))  # every row once
    for rows in batches:
        assert len(rows) == 4
        assert all((prompts[rows] == p).sum() == 2 for p in prompts[rows])  # whole prompts
    orders = {tuple(torch.cat(mini_batches(prompts, 2, seed)).tolist()) for seed in range(8)}
    assert len(orders) > 1  # shuffled: the seed decides the order of the prompts


def test_global_mini_batches_split_the_same_prompts_at_every_world_size() -> None:
    """Two ranks holding halves of 8 prompts (n = 2) cut the same global mini-batches as one
    process holding all of them; a rank may hold none of a mini-batch's prompts."""
    every = torch.arange(8).repeat_interleave(2)
    halves = (every[:8], every[8:])
    for seed in range(20):
        alone = [every[rows].unique().tolist() for rows in mini_batches(every, 2, seed, 8)]
        split = [mini_batches(half, 2, seed, 8) for half in halves]
        assert [len(s) for s in split] == [4, 4]
        for j, prompts in enumerate(alone):
            held = [half[rows] for half, rows in zip(halves, (s[j] for s in split), strict=True)]
            assert sorted(torch.cat(held).unique().tolist()) == prompts
    empty = [
        j
        for seed in range(20)
        for j, rows in enumerate(mini_batches(halves[0], 2, seed, 8))
        if len(rows) == 0
    ]
    assert empty  # some mini-batch holds only the other rank's prompts


def test_static_micro_batches_follow_the_per_gpu_sizes() -> None:
    # use_dynamic_bsz=false (verl's static mode): fixed micro-batches of
    # *_micro_batch_size_per_gpu sequences; the budgets are not used (10 tokens would not
    # hold one sequence). 8 samples; 2 mini-batches of 4 samples for the updates.
    static = [
        "actor.use_dynamic_bsz=false",
        "actor.ppo_micro_batch_size_per_gpu=1",
        "critic.ppo_micro_batch_size_per_gpu=2",
        "rollout.log_prob_micro_batch_size_per_gpu=3",
        "ref.log_prob_micro_batch_size_per_gpu=5",
        "rollout.log_prob_max_token_len_per_gpu=10",
        "ref.log_prob_max_token_len_per_gpu=10",
    ]
    assert _step_with(static, "actor")[1] == 3  # old log-probs: ceil(8 / 3)
    assert _step_with(static, "ref")[1] == 2  # ceil(8 / 5)
    assert _step_with(static, "critic")[1] == 4  # values: ceil(8 / 2)
    assert _step_with(static, "actor", grad=True)[1] == 8  # 2 × 4 / 1
    assert _step_with(static, "critic", grad=True)[1] == 4  # 2 × 4 / 2
    # Each switch on its own: the critic back on its 512-token budget (one micro-batch
    # per mini-batch), the actor still static.
    mixed = [*static, "critic.use_dynamic_bsz=true"]
    assert _step_with(mixed, "critic", grad=True)[1] == 2
    assert _step_with(mixed, "actor", grad=True)[1] == 8
    # The dynamic default for comparison: one micro-batch per mini-batch within 1024 tokens.
    assert _step_with(["actor.ppo_max_token_len_per_gpu=1024"], "actor", grad=True)[1] == 2


def test_val_batch_size_sets_the_validation_batches() -> None:
    from klppo_train.trainer.validation import validate

    tokenizer = build_tokenizer()
    _, c = components(tokenizer)
    items = PromptDataset(
        make_arithmetic_rows(8, seed=3), tokenizer, DataConfig(max_prompt_length=64)
    ).items
    sizes: list[int] = []
    generate = c.engine.generate

    def recording(prompts, sampling, **kwargs):
        sizes.append(len(prompts))
        return generate(prompts, sampling, **kwargs)

    c.engine.generate = recording
    whole = validate(c, items, load_config(None, OVERRIDES).data.val_batch_size, 8)
    batched = validate(
        c, items, load_config(None, [*OVERRIDES, "data.val_batch_size=3"]).data.val_batch_size, 8
    )
    assert sizes == [8, 3, 3, 2]
    assert whole == batched and set(whole[0]) == {"val/arithmetic/acc"}
    # The generations carry the scores the accuracy was computed from, in the set's order.
    rows = whole[1]
    assert [r["ground_truth"] for r in rows] == [i.ground_truth for i in items]
    for row in rows:
        scored = c.rewards.score("arithmetic", row["response"], row["ground_truth"], {})
        assert row["score"] == scored
    hits = [float(r["score"] >= 1.0) for r in rows]
    assert whole[0]["val/arithmetic/acc"] == sum(hits) / len(hits)
    assert validate(c, items, 0, 3)[1] == rows[:3]
