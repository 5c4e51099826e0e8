"""``trainer.task=reward_model``: train a reward model on preference pairs.

The PPO run's machinery with a reward model as its one trainee: the model sharded with
``fsdp_sharding`` (``reward_training.fsdp``, ``model.dtype`` compute), the token budget
(a number or ``auto``: probed on the real update) with the OOM back-off, checkpoints and
resume (``trainer.*``), ``metrics.jsonl`` / progress bar / plot / ``summary.json``. Per step:
one optimizer step on ``data.train_batch_size`` pairs (each rank its share); every
``trainer.test_freq`` steps the held-out pairwise accuracy (``val/rm/accuracy``). At the end
the model is exported to ``run_dir/reward_model_hf`` with the final validation scores' mean
and std in its config (:mod:`klppo_train.reward_model.hf_dir`).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForTokenClassification

from fsdp_sharding import default_device
from klppo_train.budgets.run_budgets import BUDGETS_FILE, RunBudgets, configured
from klppo_train.checks.preflight import (
    PAIR_METRICS,
    CheckedPairs,
    preflight_pairs,
    reward_model_missing,
)
from klppo_train.config.errors import UserError, user_errors
from klppo_train.config.roles import static_micro_batch_size
from klppo_train.config.schema import AppConfig, load_config
from klppo_train.data.datasets import PromptLoader
from klppo_train.loop.checkpoints import BudgetsInForce, RNGStates, Stateful
from klppo_train.loop.report import PLOTTED_RM, SHOWN_RM
from klppo_train.loop.run_dir import run_task, total_steps
from klppo_train.reward_model.export import (
    export_reward_model,
    init_score_head,
    scalar_head_config,
)
from klppo_train.reward_model.hf_dir import is_reward_model_dir
from klppo_train.reward_model.training import (
    PairBatch,
    PairwiseLoss,
    RewardTrainee,
    pairwise_accuracy,
)
from klppo_train.runtime.launch import launch_world_size
from klppo_train.runtime.precision import resolve_precision
from klppo_train.runtime.process_group import (
    is_main,
    rank_slice,
    world_size,
)
from klppo_train.trainer.assemble import adamw
from klppo_train.trainer.build import _load, _sharded, _values_not_a_view
from klppo_train.trainer.probe import QUADRATIC_ATTENTION, ProbeShape, choose_budgets
from klppo_train.trainer.schedule import make_scheduler
from klppo_train.workers.passes import Pass

log = logging.getLogger("klppo_train")
EXPORT_DIR = "reward_model_hf"


@dataclass
class RewardModelRun:
    """The run's trainee and what the probe and the checkpoints ask of a run."""

    trainee: RewardTrainee
    tokenizer: Any
    budgets: RunBudgets | None = None
    scores: list[float] = field(default_factory=list)  # the last validation's

    def pass_for(self, role: str) -> RewardTrainee | None:
        return self.trainee if role == "reward_training" else None

    def trainees(self) -> list[RewardTrainee]:
        return [self.trainee]

    def models(self) -> list:
        return [self.trainee.model]


def build_reward_model(cfg: AppConfig, model_dir: Path):
    """The reward model as klppo's passes run it (a bias-free one-label token classifier):
    a reward model's directory as it is, or a causal LM's backbone with a fresh head
    (from ``trainer.seed``), sharded with ``reward_training.fsdp``."""
    compute = resolve_precision(cfg.model.dtype, default_device())
    model = _load(
        cfg, AutoModelForTokenClassification, model_dir, torch.float32,
        config=scalar_head_config(model_dir),
    )  # fmt: skip
    if not is_reward_model_dir(model_dir):
        init_score_head(model, cfg.trainer.seed)
    model.register_forward_hook(_values_not_a_view)
    return _sharded(model, cfg.reward_training.fsdp, compute)


def reward_trainee(cfg: AppConfig, model) -> RewardTrainee:
    rt = cfg.reward_training
    return RewardTrainee(
        name="reward_model",
        model=model,
        optimizer=adamw(model, rt.lr, rt.weight_decay),
        loss=PairwiseLoss(rt.center_rewards_coefficient),
        update=Pass(
            name="update_reward_model",
            micro_batch_size=static_micro_batch_size(cfg, "reward_training"),
        ),
        epochs=1,
        rows_per_mini_batch=2 * cfg.data.train_batch_size // world_size(),
        grad_clip=rt.grad_clip,
        offload_optimizer=rt.fsdp.optimizer_offload,
    )


def probe_shape(cfg: AppConfig) -> ProbeShape:
    return ProbeShape(
        sequence=cfg.data.max_prompt_length + cfg.reward_training.max_response_length,
        response=cfg.reward_training.max_response_length,
        step_rows=2 * cfg.data.train_batch_size // world_size(),
        quadratic=cfg.model.attn_implementation in QUADRATIC_ATTENTION,
        memory_limit_gib=cfg.trainer.memory_limit_gib,
        engine_sleeps=False,
        unit_rows=2,
    )


def train_reward_model(cfg: AppConfig, checked: CheckedPairs | None = None) -> dict:
    """Train under the one loop (resuming if asked), export ``run_dir/reward_model_hf``;
    the summary."""
    checked = checked or preflight_pairs(cfg, launch_world_size())
    return run_task(cfg, lambda model_dir: RewardModelTask.build(cfg, checked, model_dir))


@dataclass
class RewardModelTask:
    """Reward-model training as a task of :mod:`klppo_train.loop.run_loop`: a step is one
    optimizer step on the loader's next pairs (each rank its share); validation is the
    held-out pairwise accuracy; the export is ``reward_model_hf``."""

    run: RewardModelRun
    checked: CheckedPairs
    loader: PromptLoader
    scheduler: Any
    total_steps: int
    configured_budget: int | str
    shape: ProbeShape
    best_export: str = EXPORT_DIR + "_best"
    label: str = "reward model"
    shown: dict = field(default_factory=lambda: dict(SHOWN_RM))
    panels: tuple = PLOTTED_RM
    validated_at: int | None = None  # the step of ``run.scores``

    @classmethod
    def build(cls, cfg: AppConfig, checked: CheckedPairs, model_dir: Path) -> RewardModelTask:
        model = build_reward_model(cfg, model_dir)
        run = RewardModelRun(reward_trainee(cfg, model), checked.tokenizer)
        d, rt = cfg.data, cfg.reward_training
        loader = PromptLoader(checked.train, d.train_batch_size, d.seed, d.shuffle)
        steps = total_steps(cfg.trainer, len(loader))
        scheduler = make_scheduler(
            run.trainee.optimizer, warmup_steps=rt.lr_warmup_steps, total_steps=steps,
            kind=rt.lr_scheduler,
        )  # fmt: skip
        budget = configured(cfg, "reward_training")
        return cls(run, checked, loader, scheduler, steps, budget, probe_shape(cfg))

    def trainees(self) -> list[RewardTrainee]:
        return self.run.trainees()

    def states(self) -> dict[str, Stateful]:
        return {"lr_scheduler/reward_model": self.scheduler, "loader": self.loader,
                "budgets": BudgetsInForce(self.run), "rng": RNGStates()}  # fmt: skip

    def start(self, first: int, run_dir: Path) -> None:
        """A checkpoint's token budget, else the config's (``auto``: probed)."""
        run = self.run
        path = run_dir / BUDGETS_FILE if is_main() else None
        if run.budgets is None:
            chosen = {"reward_training": self.configured_budget}
            run.budgets = choose_budgets(run, chosen, self.shape, path)
        else:
            run.budgets.path = path
            run.budgets.write()

    def step(self, step: int) -> dict[str, float]:
        started = time.perf_counter()
        run = self.run
        batch = PairBatch.of(rank_slice(self.loader.next_batch()), run.tokenizer.pad_token_id)
        metrics = run.trainee.train(batch, run.budgets, step)
        self.scheduler.step()
        metrics.update(run.budgets.metrics())
        metrics["timing_s/step"] = time.perf_counter() - started
        return metrics

    def validate(self, step: int) -> tuple[dict[str, float], list]:
        if not len(self.checked.val):
            return {}, []
        run = self.run
        budget, pad = run.budgets["reward_training"], run.tokenizer.pad_token_id
        pairs = self.checked.val.pairs
        metrics, run.scores = pairwise_accuracy(run.trainee.model, pairs, pad, budget)
        self.validated_at = step
        return metrics, []

    def export(self, run_dir: Path) -> None:
        scores = self.run.scores if self.validated_at == self.total_steps else []
        _export(self.run, self.checked, run_dir, scores)

    def export_best(self, run_dir: Path) -> None:
        """``reward_model_hf_best``, normalized by the validation just run."""
        _export(self.run, self.checked, run_dir, self.run.scores, self.best_export)

    @property
    def best_metric(self) -> str | None:
        return PAIR_METRICS[0] if len(self.checked.val) else None

    def close(self) -> None:
        pass


def _export(
    run: RewardModelRun, checked: CheckedPairs, run_dir: Path, scores: list, name: str = EXPORT_DIR
) -> None:
    """``name`` (``reward_model_hf``) with the mean/std of the final model's ``scores`` on the
    held-out pairs (measured here when the last step did not validate; the training
    pairs' when there are none)."""
    if not scores:
        pool = checked.val if len(checked.val) else checked.train
        _, scores = pairwise_accuracy(
            run.trainee.model, pool.pairs, run.tokenizer.pad_token_id,
            run.budgets["reward_training"],
        )  # fmt: skip
    scores = torch.tensor(scores, dtype=torch.float64)
    std = float(scores.std()) if len(scores) > 1 else 1.0
    export_reward_model(run.trainee.model, run.tokenizer, run_dir / name, float(scores.mean()), std)


def ensure_reward_model(cfg: AppConfig) -> None:
    """Train the reward model of a PPO run first when ``reward_model.path`` is missing and
    ``reward_model.source`` names its recipe (one process; under torchrun train it first),
    then put its export at ``reward_model.path``."""
    if not reward_model_missing(cfg):
        return
    rm = cfg.reward_model
    path = Path(rm.path).expanduser()
    if launch_world_size() > 1:
        raise UserError(
            f"reward_model.path={rm.path!r} is missing: under torchrun, train it first "
            f"(klppo-train {rm.source}) or give its directory"
        )
    with user_errors(f"reward_model.source={rm.source!r}: "):
        rm_cfg = load_config(rm.source)
        if rm_cfg.trainer.task != "reward_model":
            raise ValueError("not a reward-model recipe (trainer.task=reward_model)")
    log.info("reward_model.path=%s is missing: training it with %s first", rm.path, rm.source)
    train_reward_model(rm_cfg)
    export = Path(rm_cfg.trainer.run_dir).expanduser() / EXPORT_DIR
    if export.resolve() != path.resolve():
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(export, tmp)
        os.replace(tmp, path)
