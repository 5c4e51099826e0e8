"""``trainer.val_only``: validate a saved policy once, without training it (verl's key).

The policy: ``model.path`` — any HF directory, e.g. a finished run's ``actor_hf`` (empty:
the embedded default's ``<run_dir>/model``) — or, when ``trainer.resume_mode`` names a
checkpoint (``.../checkpoints/global_step_<N>``), that checkpoint's actor loaded into
``model.path``'s architecture. Built: the rollout engine (the sharded actor only to read a
checkpoint, then dropped) and, with ``reward_model.enable``, the reward model; no critic, no
reference, no optimizer. Written to ``<run_dir>/val_only/``, so a training run's own files
stay as they are: ``metrics.jsonl`` (one record, at the checkpoint's step or 0),
``val_generations.jsonl`` (``trainer.log_val_generations``), ``summary.json``,
``metrics.png``, ``config.yaml``; the chosen trackers get a run of their own.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fsdp_sharding import default_device, load_checkpoint
from klppo_train.budgets.run_budgets import RunBudgets, configured, resolve_budgets
from klppo_train.checks.preflight import Checked
from klppo_train.config.roles import AUTO, longest_sequence
from klppo_train.config.schema import AppConfig
from klppo_train.data.rewards import RewardManager
from klppo_train.loop.run_dir import prepare_run_dir
from klppo_train.loop.run_loop import finish
from klppo_train.ppo.rollouts import StepPlan
from klppo_train.reward_model.serve import RewardModelReward
from klppo_train.runtime.engine import build_engine
from klppo_train.runtime.lora import lora_of
from klppo_train.runtime.precision import Precision, resolve_precision
from klppo_train.runtime.process_group import init_distributed, is_main
from klppo_train.tracking.metrics_log import MetricsLog, Tracking
from klppo_train.trainer.assemble import StepBuilder
from klppo_train.trainer.build import _actor, _reward_model, _weight_sync
from klppo_train.trainer.run import NORMALIZATION_FILE
from klppo_train.trainer.validation import validate

log = logging.getLogger("klppo_train")
VAL_ONLY_DIR = "val_only"  # under trainer.run_dir


@dataclass
class Evaluation:
    """What :func:`klppo_train.trainer.validation.validate` reads, for a policy that is not
    trained: the engine holding its weights, the sampling plan, tokenizer, rewards, and the
    reward model with its budget."""

    engine: Any
    sampler: Any  # over the engine: single-turn or with tools, as training samples
    plan: StepPlan
    tokenizer: Any
    rewards: RewardManager
    reward_model: RewardModelReward | None = None
    budgets: RunBudgets | None = None


def evaluate(cfg: AppConfig, checked: Checked) -> dict:
    """Validate the policy once; the summary (rank 0 prints it)."""
    init_distributed(cfg.trainer.collective_timeout_s)
    e = None
    try:
        start = time.perf_counter()
        run_dir, model_dir = prepare_run_dir(cfg, VAL_ONLY_DIR)
        out = run_dir / VAL_ONLY_DIR
        e, step, rm_state = _build(cfg, checked, model_dir)
        if e.reward_model is not None:
            _set_normalization(e.reward_model, rm_state, run_dir)
        tracking = Tracking.of(cfg.trainer, asdict(cfg))
        metrics, rows = validate(
            e, checked.val.items, cfg.data.val_batch_size, tracking.generations
        )
        metrics_log = MetricsLog(out, 0, 0, tracking, enabled=is_main(), desc="validation")
        metrics_log.log(step, metrics)
        metrics_log.log_generations(step, rows)
        metrics_log.close()
        checkpoint = cfg.trainer.resume_mode not in ("auto", "disable")
        policy = cfg.trainer.resume_mode if checkpoint else str(model_dir)
        return finish(out, metrics_log, start, validated=policy)
    finally:
        if e is not None:
            e.sampler.close()
            e.engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _build(cfg: AppConfig, checked: Checked, model_dir: Path) -> tuple[Evaluation, int, dict]:
    """The evaluation's objects, the policy's step (0 without a checkpoint) and the
    checkpoint's reward-model state (``{}`` without)."""
    compute = resolve_precision(cfg.model.dtype, default_device())
    engine = build_engine(cfg, model_dir, checked.tokenizer, compute)
    step, extra = _checkpoint_into(engine, cfg, model_dir, compute)
    builder = StepBuilder(cfg)
    plan = builder.plan()
    sampler = builder.sampler(engine, checked.tokenizer, checked.tools)
    e = Evaluation(engine, sampler, plan, checked.tokenizer, checked.rewards)
    if cfg.reward_model.enable:
        model = _reward_model(cfg, compute)
        members = [_reward_model(cfg, compute, p) for p in cfg.reward_model.ensemble.paths]
        e.reward_model = builder.reward_model(
            model, checked.tokenizer, checked.rm_tokenizer, members
        )
        value, sequence = configured(cfg, "reward_model"), longest_sequence(cfg)
        # auto only with static micro-batches (checked), where the budget is not read
        unread = {"reward_model": (3 * sequence, "static")} if value == AUTO else {}
        e.budgets = resolve_budgets({"reward_model": value}, sequence, None, unread)
    return e, step, extra.get("reward_model", {})


def _checkpoint_into(engine, cfg: AppConfig, model_dir: Path, compute: Precision):
    """``(step, extra state)`` of the checkpoint ``trainer.resume_mode`` names, its actor's
    weights synced into ``engine``; ``(0, {})`` when it names none."""
    if cfg.trainer.resume_mode in ("auto", "disable"):
        return 0, {}
    path = Path(cfg.trainer.resume_mode).expanduser()
    lora = lora_of(cfg.model)  # a LoRA run's checkpoint holds the adapters
    actor, _ = _actor(cfg, model_dir, compute, lora)
    # the model only, not the optimizer
    extra = load_checkpoint(path / "actor", actor, frozen=lora is None)
    step = int(extra["step"])
    _weight_sync(actor, engine, model_dir, compute, lora).sync(version=step)
    log.info("val_only: the actor of %s (step %d)", path, step)
    return step, extra


def _set_normalization(rm: RewardModelReward, saved: dict, run_dir: Path) -> None:
    """``reward_model.normalize=reference``: the statistics the training run measured (its
    checkpoint's, else ``<run_dir>/reward_normalization.json``; preflight checked one
    exists)."""
    if rm.normalize != "reference":
        return
    if not saved:
        found = json.loads((run_dir / NORMALIZATION_FILE).read_text())
        saved = {"mean": found["mean"], "std": found["std"], "calibrated": found}
    rm.load_state_dict(saved)
