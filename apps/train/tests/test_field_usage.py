"""Every config field reaches a consumer: two real runs (vLLM and HF engines, the two
families of choices) with every read of a config field recorded; a field no code reads
(beyond its validation) is a key that is accepted and does nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from field_usage_runner import config_classes

from klppo_train.data.datasets import write_parquet
from klppo_train.demo.tasks import DATA_SOURCES

CALCULATOR = Path(__file__).resolve().parents[1] / "recipes" / "tools" / "calculator.yaml"

RUNNER = Path(__file__).with_name("field_usage_runner.py")
# Keys whose whole effect is a check against the launch (torchrun's world size).
CHECK_ONLY = {"TrainerConfig.n_gpus_per_node", "TrainerConfig.nnodes"}
# One Ulysses size for the run (the actor's): the reference's and critic's are checked
# against it (test_sequence_parallel proves the refusal).
CHECK_ONLY |= {f"{c}.ulysses_sequence_parallel_size" for c in ("RefConfig", "CriticConfig")}
# Read by the vLLM engine on CUDA only (on CPU there is no GPU memory share and no sleep
# mode; the CPU engine says so once); scripts/gpu_check.sh runs the CUDA engine.
CUDA_ONLY = {"VLLMConfig.gpu_memory_utilization", "VLLMConfig.sleep_level"}
# Read only under the policy-loss mode that uses them (one mode per run); each is shown to
# change the step under its mode in test_algorithm_zoo.py, and set under another mode it
# is refused before any model loads (checks/losses.py).
MODE_KEYS = {"ActorConfig.tau_pos", "ActorConfig.tau_neg"} | {
    f"PolicyLossConfig.{k}"
    for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")
}
# 0, 1, 0, 1, ... in the order samples are scored, whatever they say: every group of two
# varies, so dynamic sampling keeps the first batch on any CPU (a coin from the response's
# length depended on the trajectory, and an AVX2 machine's ran past max_num_gen_batches)
REWARD = (
    "import itertools\n"
    "CALLS = itertools.count()\n"
    "def score(data_source, solution_str, ground_truth, extra_info):\n"
    "    return float(next(CALLS) % 2)\n"
)


def _reads(tmp_path: Path, name: str, args: list[str]) -> set[str]:
    out = tmp_path / f"{name}.json"
    env = {
        **os.environ,
        "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", "/tmp/klppo_vllm_cache"),
    }
    done = subprocess.run(
        [sys.executable, str(RUNNER), str(out), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return set(json.loads(out.read_text()))


def _reward_model_recipe(tmp_path: Path) -> Path:
    """A ``trainer.task=reward_model`` recipe on a tiny model: static micro-batches (which
    read their size), a warm-up and the centering term. The vLLM run trains it first (its
    ``reward_model.path`` is missing)."""
    from test_reward_model import _pairs

    from klppo_train.data.pairs import check_pair_row
    from klppo_train.demo.embedded import build_model, build_tokenizer
    from klppo_train.runtime.hf_dirs import save_atomically

    run = tmp_path / "rm"
    tokenizer = build_tokenizer()
    save_atomically(build_model(len(tokenizer), seed=0, hidden=64), tokenizer, run / "model")
    write_parquet(_pairs(32, 0), run / "t.parquet", check_pair_row)
    write_parquet(_pairs(8, 1), run / "v.parquet", check_pair_row)
    recipe = {
        "trainer": {"task": "reward_model", "run_dir": str(run), "total_training_steps": 2},
        "model": {"path": str(run / "model")},
        "data": {
            "train_files": [str(run / "t.parquet")],
            "val_files": [str(run / "v.parquet")],
            "max_prompt_length": 32,
            "train_batch_size": 8,
        },
        "reward_training": {
            "max_response_length": 8,
            "use_dynamic_bsz": False,
            "micro_batch_size_per_gpu": 4,
            "lr_warmup_steps": 1,
            "center_rewards_coefficient": 0.01,
        },
    }
    (run / "recipe.yaml").write_text(json.dumps(recipe))  # JSON is YAML
    return run / "recipe.yaml"


def _vllm_run(tmp_path: Path) -> list[str]:
    """The embedded default's choices: GAE + critic, adaptive KL in the reward, rollout
    correction's bypass mode (weights and rejection in the loss), budgets
    (one of them ``auto``: probed, which reads ``trainer.memory_limit_gib``); a reward model
    (trained first by :func:`_reward_model_recipe`) scoring (normalized on the reference's
    samples, combined with the rule; with itself as a second member of an ensemble) and
    starting the critic (LoRA on its backbone)."""
    run = tmp_path / "a"
    rm = tmp_path / "rm_served"  # missing: the recipe trains it, its export is copied here
    return [
        "reward_model.enable=true",
        f"reward_model.path={rm}",
        f"reward_model.source={_reward_model_recipe(tmp_path)}",
        "reward_model.normalize=reference",
        "reward_model.normalize_samples=8",
        "reward_model.combine=sum",
        "reward_model.use_dynamic_bsz=false",
        "reward_model.missing_eos_penalty=0.5",
        f"reward_model.ensemble.paths=[{rm}]",  # exists once the recipe has trained it
        "reward_model.ensemble.reduce=mean",
        f"critic.model_path={rm}",
        f"trainer.run_dir={run}",
        f"data.train_files=[{run}/data/train.parquet]",
        f"data.val_files=[{run}/data/val.parquet]",
        "model.warmup_steps=5",
        "trainer.total_training_steps=2",
        "trainer.save_freq=1",
        "trainer.max_ckpt_to_keep=1",
        "trainer.test_freq=1",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=4",
        "critic.ppo_mini_batch_size=4",
        "rollout.n=4",
        "ref.log_prob_max_token_len_per_gpu=auto",
        "critic.use_dynamic_bsz=false",  # read only in static mode
        "critic.ppo_micro_batch_size_per_gpu=8",
        "critic.lora_rank=4",  # LoRA on the reward model's backbone, its head in full
        "critic.lora_alpha=8",
        "algorithm.rollout_correction.bypass_mode=true",  # in the loss, per micro-batch
        "algorithm.rollout_correction.loss_type=reinforce",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_threshold=3.0",
        "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=0.2_5.0",
    ]


def _hf_run(tmp_path: Path) -> list[str]:
    """The other choices: GRPO without a critic, KL in the loss, static micro-batches, a
    custom reward shaped by DAPO's overlong penalty and filtered by its dynamic sampling,
    epochs instead of steps, an overlong prompt filtered out, LoRA on two of the layers (the
    reference: the actor without its adapters), decoupled rollout correction (its
    old-log-prob pass reads the static micro-batch size); multi-turn rollouts with the
    calculator, of a tiny model that calls it (``model.source=tiny-calculator``), generated
    a step ahead of training (``async_training``)."""
    run = tmp_path / "b"
    train, val = DATA_SOURCES["calculator_multiply"]()
    long = {**train[0], "prompt": [{"role": "user", "content": "What is 2*3? " * 12}]}
    write_parquet([*train[:16], long], run / "t.parquet")
    write_parquet(val[:6], run / "v.parquet")
    (run / "reward.py").write_text(REWARD)
    return [
        f"trainer.run_dir={run}",
        f"data.train_files=[{run / 't.parquet'}]",
        f"data.val_files=[{run / 'v.parquet'}]",
        "data.max_prompt_length=48",
        f"reward.custom={run / 'reward.py'}:score",
        "model.source=tiny-calculator",
        f"model.path={run / 'model'}",
        "rollout.response_length=64",
        "rollout.multi_turn.enable=true",
        f"rollout.multi_turn.tool_config_path={CALCULATOR}",
        "rollout.multi_turn.max_assistant_turns=3",
        "rollout.multi_turn.max_user_turns=2",
        "rollout.multi_turn.max_parallel_calls=2",
        "rollout.multi_turn.max_tool_response_length=64",
        "rollout.multi_turn.tool_response_truncate_side=left",
        "rollout.multi_turn.format=hermes",
        "rollout.multi_turn.tool_timeout_s=5",
        "rollout.engine=hf",
        "trainer.total_training_steps=0",
        "trainer.total_epochs=1",
        "data.train_batch_size=8",
        "data.val_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "rollout.n=2",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        "algorithm.kl_ctrl.type=fixed",
        "critic.enable=false",
        "actor.use_kl_loss=true",
        "actor.entropy_coeff=0.01",
        "actor.use_dynamic_bsz=false",
        "actor.ppo_micro_batch_size_per_gpu=2",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        "model.target_modules=[q_proj,v_proj]",
        "algorithm.rollout_correction.rollout_is=sequence",  # decoupled, before advantages
        "algorithm.rollout_correction.rollout_is_batch_normalize=true",
        "reward_model.overlong_buffer.enable=true",  # DAPO's penalty on the rule reward
        "reward_model.overlong_buffer.len=2",
        "reward_model.overlong_buffer.penalty_factor=0.5",
        "reward_model.overlong_buffer.log=true",
        "algorithm.filter_groups.enable=true",  # DAPO's dynamic sampling on the shaped reward
        "algorithm.filter_groups.metric=seq_reward",
        "algorithm.filter_groups.max_num_gen_batches=10",
        "async_training.enable=true",  # each batch generated a step ahead (with LoRA, tools)
        "async_training.max_staleness_steps=1",
    ]


@pytest.mark.slow  # two short real runs (one starts vLLM, after training a reward model)
def test_every_config_field_is_read_by_the_trainer(tmp_path: Path) -> None:
    reads = _reads(tmp_path, "vllm", _vllm_run(tmp_path)) | _reads(
        tmp_path, "hf", _hf_run(tmp_path)
    )
    assert (tmp_path / "rm_served" / "config.json").is_file()  # trained first, then copied
    every = {f"{cls.__name__}.{f.name}" for cls in config_classes() for f in fields(cls)}
    sections = {
        f"{cls.__name__}.{f.name}"
        for cls in config_classes()
        for f in fields(cls)
        if f.name
        in (
            "data",
            "model",
            "actor",
            "ref",
            "critic",
            "rollout",
            "algorithm",
            "reward",
            "reward_model",
            "reward_training",
            "trainer",
            "fsdp",
            "kl_ctrl",
            "rollout_correction",
            "policy_loss",
            "overlong_buffer",
            "ensemble",
            "filter_groups",
            "sampling",
            "vllm",
            "hf",
            "mixed_precision",
            "multi_turn",
            "async_training",
        )
    }
    unread = every - reads - CHECK_ONLY - CUDA_ONLY - MODE_KEYS - sections
    assert not unread, f"config fields no code reads: {sorted(unread)}"
