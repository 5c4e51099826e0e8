"""Config loading (YAML + dotted overrides), unknown keys, validation, recipes, the CLI."""

import os
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from fsdp_sharding import MixedPrecision, ShardingConfig
from klppo_train.__main__ import main
from klppo_train.checks.validate import validate_config
from klppo_train.config.schema import AppConfig, load_config, to_yaml
from klppo_train.runtime.precision import role_sharding
from rollout import SamplingConfig, VLLMConfig

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
_CRITIC_OFF = ["critic.enable=false", "algorithm.adv_estimator=grpo"]


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_recipe_loads_and_validates(recipe: Path) -> None:
    config = load_config(recipe)
    assert isinstance(config, AppConfig)
    assert validate_config(config) == [] or all(isinstance(a, str) for a in validate_config(config))


# Each recipe's paths that live under its run dir (the rest are shared or the user's).
OWN_PATHS = {
    "default": ("data.train_files", "data.val_files"),
    "smollm2_arith": ("data.train_files", "data.val_files", "model.path"),
    "smollm2_arith_grpo": ("data.train_files", "data.val_files"),
    "smollm2_arith_lora": ("data.train_files", "data.val_files", "model.path"),
    "smollm2_arith_grpo_lora": ("data.train_files", "data.val_files"),
    "smollm2_rm": ("data.train_files", "data.val_files"),
    "smollm2_rlhf": ("data.train_files", "data.val_files"),
}


@pytest.mark.parametrize("name", OWN_PATHS)
def test_a_recipes_own_paths_follow_its_run_dir(name: str, tmp_path: Path) -> None:
    cfg = load_config(RECIPES / f"{name}.yaml", [f"trainer.run_dir={tmp_path / 'x'}"])
    for key in OWN_PATHS[name]:
        section, field = key.split(".")
        value = getattr(getattr(cfg, section), field)
        for path in (value,) if isinstance(value, str) else value:
            assert Path(path).is_relative_to(tmp_path / "x"), (key, path)


def test_gsm8k_recipe_keeps_verl_quickstart_values() -> None:
    c = load_config(RECIPES / "qwen2.5-0.5b-gsm8k.yaml")
    assert (c.data.train_batch_size, c.actor.ppo_mini_batch_size) == (256, 64)
    assert (c.data.max_prompt_length, c.rollout.sampling.max_new_tokens) == (512, 512)
    assert (c.actor.lr, c.critic.lr, c.algorithm.kl_ctrl.kl_coef) == (1e-6, 1e-5, 0.001)
    assert c.rollout.vllm.gpu_memory_utilization == 0.4
    validate_config(c, world_size=8)  # 64 prompts × 1 sample split over 8 GPUs


def test_yaml_then_overrides(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("actor:\n  lr: 0.5\nrollout:\n  n: 4\n")
    c = load_config(recipe, ["actor.ppo_max_token_len_per_gpu=16384", "rollout.n=2"])
    assert (c.actor.lr, c.actor.ppo_max_token_len_per_gpu, c.rollout.sampling.n) == (0.5, 16384, 2)
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
        ("algoritm.gamma=1", "unknown config key 'algoritm.gamma'; did you mean 'algorithm'"),
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
        (["rollout.temperature=-1"], "rollout.sampling.temperature must be >= 0, got -1"),
        (["actor.fsdp.strategy=zero3"], "actor.fsdp.strategy='zero3'; valid: fsdp2, fsdp1"),
        (["critic.fsdp.mixed_precision.buffer_dtype=int8"], "critic.fsdp.mixed_precision.buffer"),
        (["rollout.vllm.sleep_level=3"], "rollout.vllm.sleep_level must be 1 or 2, got 3"),
        (["rollout.hf.max_tokens_per_batch=0"], "rollout.hf.max_tokens_per_batch must be >= 1"),
        (["actor.loss_agg_mode=sum"], "actor.loss_agg_mode='sum'"),
        (
            ["model.attn_implementation=sdpa", "model.share_prompts=true"],
            "model.share_prompts=true needs model.attn_implementation=klppo_varlen",
        ),
    ],
)
def test_validation_names_the_key(overrides, match) -> None:
    with pytest.raises(ValueError, match=match):
        validate_config(load_config(None, overrides))


def test_prompts_per_step_must_split_evenly_over_ranks() -> None:
    # verl's failure case: 6 prompts (mini-batch 6, n=2) over 4 ranks held 2/4/2/4 samples
    c = load_config(
        None,
        [*_CRITIC_OFF, "data.train_batch_size=6", "actor.ppo_mini_batch_size=6", "rollout.n=2"],
    )
    with pytest.raises(
        ValueError, match="data.train_batch_size=6 prompts do not split evenly over 4"
    ):
        validate_config(c, world_size=4)
    validate_config(c, world_size=2)  # 3 prompts × 2 samples each


def test_world_size_divisibility() -> None:
    keys = [
        "data.train_batch_size=12",
        "actor.ppo_mini_batch_size=4",
        "critic.ppo_mini_batch_size=4",
    ]
    with pytest.raises(ValueError, match="4 samples do not split over 3 ranks"):
        validate_config(load_config(None, keys), world_size=3)


def test_sections_hold_the_packages_configs() -> None:
    """Compose, don't mirror: every field of the package configs is a key."""
    c = load_config(
        None,
        [
            "actor.fsdp.strategy=fsdp1",
            "actor.fsdp.reshard_after_forward=false",
            "critic.fsdp.reshard_after_forward=2",  # FSDP2's smaller reshard group
            "critic.fsdp.mixed_precision.reduce_dtype=bf16",
            "rollout.sampling.stop_token_ids=[7,9]",
            "rollout.vllm.distributed_executor_backend=uni",
            "rollout.hf.max_tokens_per_batch=2048",
        ],
    )
    assert type(c.actor.fsdp) is ShardingConfig and type(c.rollout.sampling) is SamplingConfig
    assert type(c.rollout.vllm) is VLLMConfig
    assert (c.actor.fsdp.strategy, c.actor.fsdp.reshard_after_forward) == ("fsdp1", False)
    assert c.critic.fsdp.reshard_after_forward == 2
    assert c.critic.fsdp.mixed_precision == MixedPrecision(reduce_dtype="bfloat16")
    assert c.rollout.sampling.stop_token_ids == (7, 9)
    assert c.rollout.vllm.distributed_executor_backend == "uni"
    assert c.rollout.hf.max_tokens_per_batch == 2048


def test_short_names_stand_for_the_package_fields() -> None:
    c = load_config(
        None,
        [
            "rollout.n=3",
            "rollout.response_length=77",
            "rollout.gpu_memory_utilization=0.3",
            "ref.fsdp.param_dtype=bfloat16",
            "model.gradient_checkpointing=true",
        ],
    )
    assert (c.rollout.sampling.n, c.rollout.sampling.max_new_tokens) == (3, 77)
    assert c.rollout.vllm.gpu_memory_utilization == 0.3
    assert c.ref.fsdp.mixed_precision.param == torch.bfloat16
    assert c.actor.fsdp.gradient_checkpointing and c.critic.fsdp.gradient_checkpointing
    assert not c.ref.fsdp.gradient_checkpointing


def test_role_sharding_fills_unset_dtypes_from_model_dtype() -> None:
    c = load_config(None, ["critic.fsdp.mixed_precision.param_dtype=float32"])
    actor = role_sharding(c.actor.fsdp, torch.bfloat16).mixed_precision
    assert (actor.param, actor.reduce, actor.buffer) == (
        torch.bfloat16,
        torch.float32,
        torch.float32,
    )
    assert role_sharding(c.critic.fsdp, torch.bfloat16).mixed_precision.param == torch.float32


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("rollout.vllm.seed=3", "rollout.vllm.seed=3: set by klppo \\(from trainer.seed\\)"),
        ("rollout.sampling.seed=5", "rollout.sampling.seed=5: set by klppo"),
        ("rollout.vllm.max_model_len=64", "data.max_prompt_length \\+ rollout.response_length"),
        ("rollout.vllm.dtype=float16", "from model.dtype"),
        ("rollout.hf.pad_token_id=0", "the tokenizer's"),
        ("model.gradient_checkpointing=yes_please", "bad value for config key"),
        ("ref.fsdp.gradient_checkpointing=true", "the reference runs no backward"),
    ],
)
def test_keys_klppo_sets_itself_are_refused(override: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_config(None, [override])


def test_a_printed_config_loads_back_as_a_recipe(tmp_path: Path) -> None:
    c = load_config(None, ["rollout.n=4", "actor.fsdp.param_dtype=bf16", "critic.enable=false"])
    recipe = tmp_path / "printed.yaml"
    recipe.write_text(to_yaml(c))
    assert load_config(recipe) == c


def test_cli_prints_config_and_reports_errors(capsys) -> None:
    assert main(["--print-config", "rollout.n=3"]) == 0
    out = capsys.readouterr().out
    assert "'n': 3" in out  # YAML quotes n (a 1.1 bool)
    assert f"klppo-ppo-core {version('klppo-ppo-core')}" in out
    assert main(["actor.lrr=1"]) == 2
    assert "did you mean 'actor.lr'" in capsys.readouterr().err


VERL_QUICKSTART = [  # verl's PPO quickstart command (GSM8K, Qwen2.5-0.5B), its keys verbatim
    "data.train_files=train.parquet",
    "data.val_files=test.parquet",
    "data.train_batch_size=256",
    "data.max_prompt_length=512",
    "data.max_response_length=512",
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "critic.optim.lr=1e-5",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "algorithm.kl_ctrl.kl_coef=0.001",
    "trainer.logger=console",
    "trainer.val_before_train=False",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.save_freq=10",
    "trainer.test_freq=10",
    "trainer.total_epochs=15",
]


def test_verl_quickstart_command_resolves_to_klppo_keys() -> None:
    c = load_config(None, VERL_QUICKSTART)
    assert (c.data.train_files, c.data.val_files) == (("train.parquet",), ("test.parquet",))
    assert (c.data.train_batch_size, c.data.max_prompt_length) == (256, 512)
    assert c.rollout.sampling.max_new_tokens == 512 and c.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert (c.actor.lr, c.actor.ppo_mini_batch_size, c.actor.ppo_micro_batch_size_per_gpu) == (
        1e-6,
        64,
        4,
    )
    assert c.rollout.log_prob_micro_batch_size_per_gpu == 8
    assert c.rollout.vllm.gpu_memory_utilization == 0.4
    assert c.ref.log_prob_micro_batch_size_per_gpu == 4
    assert (c.critic.lr, c.critic.ppo_micro_batch_size_per_gpu) == (1e-5, 4)
    assert c.algorithm.kl_ctrl.kl_coef == 0.001
    assert c.trainer.val_before_train is False
    assert (c.trainer.n_gpus_per_node, c.trainer.nnodes) == (1, 1)
    assert (c.trainer.save_freq, c.trainer.test_freq, c.trainer.total_epochs) == (10, 10, 15)
    validate_config(c, world_size=1)
    with pytest.raises(ValueError, match=r"n_gpus_per_node=1 × trainer.nnodes=1 .* world size 2"):
        validate_config(c, world_size=2)


def test_verl_names_in_a_recipe_and_their_values(tmp_path: Path) -> None:
    recipe = tmp_path / "verl.yaml"
    recipe.write_text(
        "actor_rollout_ref:\n"
        "  actor:\n"
        "    strategy: fsdp\n"
        "    clip_ratio: 0.28\n"
        "    ppo_max_token_len_per_gpu: 16384\n"
        "    fsdp_config:\n"
        "      forward_prefetch: 2\n"
        "  model:\n"
        "    enable_gradient_checkpointing: true\n"
        "    use_remove_padding: true\n"
        "critic:\n"
        "  strategy: fsdp2\n"
        "  model:\n"
        "    fsdp_config:\n"
        "      param_offload: true\n"
    )
    c = load_config(recipe, ["actor_rollout_ref.ref.fsdp_config.reshard_after_forward=false"])
    assert c.actor.fsdp.strategy == "fsdp1" and c.critic.fsdp.strategy == "fsdp2"
    assert (c.actor.clip_ratio_low, c.actor.clip_ratio_high) == (0.28, 0.28)
    assert c.actor.ppo_max_token_len_per_gpu == 16384 and c.actor.fsdp.gradient_checkpointing
    assert not c.critic.fsdp.gradient_checkpointing  # verl's actor model flag: the actor's
    assert c.critic.fsdp.param_offload and c.ref.fsdp.reshard_after_forward is False
    # forward_prefetch keeps its depth (it used to become `true`)
    assert c.actor.fsdp.forward_prefetch_depth == 2


def test_every_bad_key_of_a_command_is_reported_at_once() -> None:
    bad = [
        "actor.lrr=1",
        "critic.foo=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "trainer.experiment_nam=x",
    ]
    with pytest.raises(ValueError) as err:
        load_config(None, [*bad, "actor.lr=0.1"])
    message = str(err.value)
    assert "\n" not in message
    assert "unknown config key 'actor.lrr'; did you mean 'actor.lr'?" in message
    assert "unknown config key 'critic.foo'" in message
    assert "without tensor parallelism: only 1" in message
    assert "always packs sequences (remove padding): only true" in message
    assert "not Megatron" in message
    assert "did you mean 'trainer.experiment_name'?" in message
    # the accepted values of refused keys pass (verl's defaults)
    ok = ["actor_rollout_ref.rollout.tensor_model_parallel_size=1", "trainer.logger=console"]
    assert load_config(None, ok).actor.lr == AppConfig().actor.lr


def test_docs_table_of_verl_names_is_current() -> None:
    from klppo_train.config.verl_names import DOC_HEADER, markdown_table

    doc = Path(__file__).resolve().parents[3] / "docs" / "verl-names.md"
    assert doc.read_text() == DOC_HEADER + markdown_table()


def test_verbose_brings_the_libraries_logs_back(monkeypatch) -> None:
    import logging

    from klppo_train.console import QUIET, configure_output

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    for name in QUIET:
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    configure_output(verbose=True)
    assert all(logging.getLogger(name).level == logging.NOTSET for name in QUIET)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO"
    monkeypatch.delenv("VLLM_LOGGING_LEVEL")
    configure_output(verbose=False)
    assert logging.getLogger("fsdp_sharding").level == logging.WARNING
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"


def test_explain_documents_every_key_and_loads_back(tmp_path: Path, capsys) -> None:
    """``--print-config --explain``: every field of every section has its text (attribute
    docstrings, or the package configs' ``Attributes:``), printed above the key; the output
    is still a recipe."""
    from dataclasses import fields

    from field_usage_runner import config_classes

    from klppo_train.config.explain import field_docs

    for cls in config_classes():
        missing = [f.name for f in fields(cls) if f.name not in field_docs(cls)]
        assert not missing, f"{cls.__name__}: no documentation for {missing}"
    assert main(["--explain", "actor.lr=3e-6", "rollout.n=4"]) == 0
    out = capsys.readouterr().out
    text = out.split("\n", 1)[1]  # after the versions line
    assert "  # AdamW learning rate.\n  lr: 3.0e-06" in text
    assert "    # nucleus mass in (0, 1]; 1 = off.\n    top_p: 1.0" in text
    recipe = tmp_path / "explained.yaml"
    recipe.write_text(text)
    from klppo_train.cli import default_recipe

    assert load_config(recipe) == load_config(default_recipe(), ["actor.lr=3e-6", "rollout.n=4"])


def test_verl_reward_model_names() -> None:
    cfg = load_config(
        None,
        [
            "reward_model.enable=true",
            "reward_model.model.path=/rm",
            "reward_model.model.input_tokenizer=null",
            "reward_model.micro_batch_size_per_gpu=4",
            "reward_model.model.fsdp_config.param_offload=false",
            "reward_model.model.use_remove_padding=true",
            "critic.model.path=/rm",
        ],
    )
    assert cfg.reward_model.path == "/rm" and cfg.critic.model_path == "/rm"
    assert cfg.reward_model.retemplate == "never" and cfg.reward_model.micro_batch_size_per_gpu == 4
    tokenizer = load_config(None, ["reward_model.model.input_tokenizer=/policy"])
    assert tokenizer.reward_model.retemplate == "auto"
    with pytest.raises(ValueError, match="reward_model.max_length=512: klppo scores"):
        load_config(None, ["reward_model.max_length=512"])
    assert load_config(None, ["reward_model.use_dynamic_bsz=null"]).reward_model.use_dynamic_bsz


SP_VERL = "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"
SHARING_OFF = (
    "model.share_prompts off: Ulysses sequence parallelism "
    "(actor.ulysses_sequence_parallel_size=2) does not share prompts"
)


@pytest.mark.parametrize(
    ("overrides", "shared", "said"),
    [
        ([], True, False),  # unset: on
        (["model.share_prompts=null"], True, False),  # null is unset
        (["model.share_prompts=false"], False, False),
        ([SP_VERL], False, True),  # unset with Ulysses (verl's name): off, and one line
        (["actor.ulysses_sequence_parallel_size=2"], False, True),  # klppo's name
        ([SP_VERL, "model.share_prompts=false"], False, False),  # the user's own choice
        ([SP_VERL, "model.share_prompts=true"], True, False),  # kept: validation refuses it
        ([SP_VERL, "trainer.task=reward_model"], True, False),  # no Ulysses in that task
    ],
)
def test_share_prompts_unset_gives_way_to_sequence_parallelism(
    overrides, shared, said, caplog
) -> None:
    """Issue 40: ``model.share_prompts`` is a default of klppo's; set, it is the user's."""
    with caplog.at_level("INFO", logger="klppo_train"):
        cfg = load_config(None, overrides)
    assert cfg.model.share_prompts is shared
    lines = [r.getMessage() for r in caplog.records if "share_prompts" in r.getMessage()]
    assert lines == ([SHARING_OFF] if said else [])
    if SP_VERL in overrides and cfg.trainer.task == "ppo":
        if shared:
            with pytest.raises(ValueError, match="model.share_prompts=true with actor.ulysses"):
                validate_config(cfg, world_size=2)
        else:
            validate_config(cfg, world_size=2)
    # the printed config holds the resolved value and loads back to the same run
    assert f"share_prompts: {str(shared).lower()}" in to_yaml(cfg)


@pytest.mark.parametrize("attention", ["sdpa", "eager", "flash_attention_2"])
def test_share_prompts_unset_gives_way_to_a_dense_attention(attention, caplog) -> None:
    """An attention that cannot share prompt tokens, chosen by the user, turns the default
    off (one line) instead of failing; an explicit ``share_prompts=true`` still fails."""
    choice = f"model.attn_implementation={attention}"
    with caplog.at_level("INFO", logger="klppo_train"):
        cfg = load_config(None, [choice])
    assert cfg.model.share_prompts is False
    validate_config(cfg)
    lines = [r.getMessage() for r in caplog.records if "share_prompts" in r.getMessage()]
    assert lines == [f"model.share_prompts off: {choice} does not share prompts"]
    explicit = load_config(None, [choice, "model.share_prompts=true"])
    with pytest.raises(ValueError, match="model.share_prompts=true needs"):
        validate_config(explicit)


def test_rlhf_recipes_critic_follows_its_reward_model() -> None:
    """``smollm2_rlhf.yaml``'s critic starts from its reward model wherever that is: the
    ``${reward_model.path}`` interpolation resolves after the layers merge, and verl's names
    are renamed in each layer before it, so ``reward_model.model.path`` moves it too."""
    recipe = RECIPES / "smollm2_rlhf.yaml"
    cfg = load_config(recipe)
    assert cfg.critic.model_path == cfg.reward_model.path == "runs/smollm2_rm/reward_model_hf"
    for key in ("reward_model.path", "reward_model.model.path"):
        cfg = load_config(recipe, [f"{key}=/elsewhere/rm"])
        assert cfg.reward_model.path == cfg.critic.model_path == "/elsewhere/rm", key
    both = ["reward_model.model.path=/elsewhere/rm", "critic.model.path=/own/critic"]
    assert load_config(recipe, both).critic.model_path == "/own/critic"  # set: the user's


def test_schema_merges_even_where_omegaconf_marks_frozen_sections_read_only() -> None:
    """omegaconf 2.3 (hydra-core 1.3's pin) flags a frozen dataclass's node read-only, which
    made every recipe fail to merge on it (seen on the GPU machine, which has 2.3: "ListConfig
    is read-only full_key: data.train_files[0]"); 2.4, which the lock holds, does not flag
    them. Flag every node as 2.3 does: ``_writable`` must clear each flag, lists included."""
    from omegaconf import Container, DictConfig, OmegaConf

    from klppo_train.config.schema import _writable

    def nodes(node):  # every node under ``node``, itself included
        yield node
        if isinstance(node, DictConfig) and not node._is_none():
            for key in node:
                yield from nodes(node._get_node(key))
        elif isinstance(node, Container) and not node._is_none():
            for index in range(len(node)):
                yield from nodes(node._get_node(index))

    base = OmegaConf.structured(AppConfig)
    for node in nodes(base):
        node._set_flag("readonly", True)
    flagged = [n for n in nodes(base) if n._get_node_flag("readonly")]
    assert len(flagged) > 200 and "('all-linear',)" in map(repr, flagged)  # a list's too
    assert not [n for n in nodes(_writable(base)) if n._get_node_flag("readonly")]
    layer = {"data": {"train_files": ["/x.parquet"], "source": "s"}, "actor": {"ppo_epochs": 2}}
    built = OmegaConf.to_object(OmegaConf.merge(base, layer))
    assert built.data.train_files == ("/x.parquet",) and built.actor.ppo_epochs == 2
