"""The ``data`` section: where the prompts come from and how they are tokenized and batched
(read by :mod:`klppo_train.data.datasets`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

TRUNCATION_MODES = ("error", "left", "right")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the prompts come from and how they are tokenized and batched.

    Attributes:
        train_files: parquet files of training prompts. Empty by default so the app config
            can build ``DataConfig()`` as a schema default; :func:`read_rows` rejects an
            empty list when the data is actually loaded.
        val_files: parquet files of validation prompts (may stay empty: no validation).
        max_prompt_length: longest prompt, in tokens, after the chat template.
        truncation: what to do with a longer prompt when it is not filtered out: "error"
            raises, "left" keeps the last ``max_prompt_length`` tokens, "right" the first.
        filter_overlong_prompts: drop (and count) longer prompts instead of truncating.
        shuffle: reshuffle the training prompts every epoch.
        seed: shuffle seed; epoch e uses ``seed + e``.
        train_batch_size: prompts per training step, across all ranks.
        gen_batch_size: prompts per generation round of DAPO's dynamic sampling
            (``algorithm.filter_groups``; verl's): the loader's batch, of which the first
            ``train_batch_size`` groups that vary are trained on; None = train_batch_size.
        val_batch_size: prompts per validation batch; None means the whole validation set.
        source: a registered data set (:mod:`klppo_train.data.sources`) written at the
            train/val paths when they are missing (under ``trainer.run_dir/data``); "" = none.
    """

    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()
    max_prompt_length: int = 512
    truncation: str = "error"
    filter_overlong_prompts: bool = True
    shuffle: bool = True
    seed: int = 1
    train_batch_size: int = 8
    gen_batch_size: int | None = None
    val_batch_size: int | None = None
    source: str = ""

    @property
    def loader_batch_size(self) -> int:
        """Prompts the loader gives a step (a generation round)."""
        return self.gen_batch_size or self.train_batch_size

    def __post_init__(self) -> None:
        # A single path is a common slip in YAML/CLI overrides: accept it as a 1-tuple.
        for name in ("train_files", "val_files"):
            files = getattr(self, name)
            files = (files,) if isinstance(files, str | os.PathLike) else tuple(files)
            if not all(isinstance(f, str | os.PathLike) and str(f) for f in files):
                raise ValueError(f"data.{name} must hold non-empty paths, got {files!r}")
            object.__setattr__(self, name, tuple(str(f) for f in files))
        _check_int("max_prompt_length", self.max_prompt_length, low=1)
        _check_int("train_batch_size", self.train_batch_size, low=1)
        if self.gen_batch_size is not None:
            _check_int("gen_batch_size", self.gen_batch_size, low=1)
        _check_int("seed", self.seed, low=None)
        if self.val_batch_size is not None:
            _check_int("val_batch_size", self.val_batch_size, low=1)
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(
                f"data.truncation must be one of {TRUNCATION_MODES}, got {self.truncation!r}"
            )
        for name in ("filter_overlong_prompts", "shuffle"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"data.{name} must be a bool, got {getattr(self, name)!r}")


def _check_int(name: str, value: Any, low: int | None) -> None:
    # bool is an int subclass; `max_prompt_length: true` is a typo, not 1.
    if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
        bound = f" >= {low}" if low is not None else ""
        raise ValueError(f"data.{name} must be an int{bound}, got {value!r}")
