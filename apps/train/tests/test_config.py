"""Config loading (YAML + dotted overrides), unknown keys, validation, recipes, the CLI."""

from pathlib import Path

import pytest

from klppo_train.__main__ import main
from klppo_train.config import AppConfig, load_config, to_yaml
from klppo_train.validate import sharding_config, validate_config

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_recipe_loads_and_validates(recipe: Path) -> None:
    config = load_config(recipe)
    assert isinstance(config, AppConfig)
    assert validate_config(config) == [] or all(isinstance(a, str) for a in validate_config(config))


def test_gsm8k_recipe_keeps_verl_quickstart_values() -> None:
    c = load_config(RECIPES / "qwen2.5-0.5b-gsm8k.yaml")
    assert (c.data.train_batch_size, c.actor.ppo_mini_batch_size) == (256, 64)
    assert (c.data.max_prompt_length, c.rollout.response_length) == (512, 512)
    assert (c.actor.lr, c.critic.lr, c.algorithm.kl_ctrl.kl_coef) == (1e-6, 1e-5, 0.001)
    assert c.rollout.gpu_memory_utilization == 0.4
    validate_config(c, world_size=8)  # 64 prompts × 1 sample split over 8 GPUs


def test_yaml_then_overrides(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("actor:\n  lr: 0.5\nrollout:\n  n: 4\n")
    c = load_config(recipe, ["actor.ppo_max_token_len_per_gpu=16384", "rollout.n=2"])
    assert (c.actor.lr, c.actor.ppo_max_token_len_per_gpu, c.rollout.n) == (0.5, 16384, 2)
    assert c.critic.lr == AppConfig().critic.lr  # untouched default
    assert "ppo_max_token_len_per_gpu: 16384" in to_yaml(c)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (
            "actor.ppo_max_token_len_per_gpo=1",
            "unknown config key 'actor.ppo_max_token_len_per_gpo'; "
            "did you mean 'actor.ppo_max_token_len_per_gpu'",
        ),
        ("algoritm.gamma=1", "unknown config key 'algoritm'; did you mean 'algorithm'"),
        ("actor.lr=fast", "bad value for config key 'actor.lr'"),
    ],
)
def test_unknown_keys_and_bad_types(override: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_config(None, [override])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["actor.clip_ratio_low=1.5"], "actor.clip_ratio_low must be in \\(0, 1\\)"),
        (["algorithm.lam=1.2"], "algorithm.lam must be in \\[0, 1\\]"),
        (["algorithm.kl_ctrl.kl_coef=-1"], "algorithm.kl_ctrl.kl_coef must be >= 0"),
        (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator='ppo'; valid: gae, grpo"),
        (["algorithm.adv_estimator=grpo", "rollout.n=1"], "rollout.n must be >= 2"),
        (["algorithm.adv_estimator=gae", "critic.enable=false"], "needs a critic"),
        (
            ["data.train_batch_size=10", "actor.ppo_mini_batch_size=4"],
            "data.train_batch_size=10 is not divisible by actor.ppo_mini_batch_size=4",
        ),
        (
            ["actor.use_dynamic_bsz=false", "actor.ppo_micro_batch_size_per_gpu=3"],
            "not divisible by actor.ppo_micro_batch_size_per_gpu=3",
        ),
        (
            ["actor.ppo_max_token_len_per_gpu=100"],
            "actor.ppo_max_token_len_per_gpu: actor=100 is below max_prompt_len",
        ),
        (["rollout.temperature=-1"], "rollout: SamplingConfig.temperature"),
        (["actor.fsdp.strategy=zero3"], "actor.fsdp: ShardingConfig.strategy"),
        (["actor.loss_agg_mode=sum"], "actor.loss_agg_mode='sum'"),
    ],
)
def test_validation_names_the_key(overrides, match) -> None:
    with pytest.raises(ValueError, match=match):
        validate_config(load_config(None, overrides))


def test_world_size_divisibility() -> None:
    config = load_config(None, ["actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8"])
    with pytest.raises(ValueError, match="8 samples do not split over 3 ranks"):
        validate_config(config, world_size=3)


def test_sharding_config_mirror() -> None:
    config = load_config(None, ["actor.fsdp.param_dtype=bfloat16", "actor.fsdp.strategy=fsdp1"])
    sharding = sharding_config(config.actor.fsdp)
    assert (
        sharding.strategy == "fsdp1"
        and str(sharding.mixed_precision.param_dtype) == "torch.bfloat16"
    )


def test_cli_prints_config_and_reports_errors(capsys) -> None:
    assert main(["--print-config", "rollout.n=3"]) == 0
    out = capsys.readouterr().out
    assert "'n': 3" in out and "klppo-ppo-core 0.1.0" in out  # YAML quotes n (a 1.1 bool)
    assert main(["actor.lrr=1"]) == 2
    assert "did you mean 'actor.lr'" in capsys.readouterr().err
