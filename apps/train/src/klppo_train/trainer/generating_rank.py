"""The generating rank of a run with ``async_training.rollout_ranks`` (:func:`generate`):
the rollout engine only, no sharded model. It waits for the training rank's ``start`` (the
run directory and the model are ready then), builds the engine (and says ``up`` to the
training ranks: the link's timeout starts there), the sampler and the step's
rollout source as a colocated run would (dynamic sampling, ReMax's baselines, tools), and
serves batches and validations until ``stop``
(:func:`klppo_train.ppo.rollout_ranks.serve`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fsdp_sharding import default_device
from klppo_train.checks.preflight import Checked
from klppo_train.config.schema import AppConfig
from klppo_train.data.datasets import PromptLoader
from klppo_train.loop.preemption import Preempted, Preemption
from klppo_train.loop.run_dir import ensure_model_dir, total_steps
from klppo_train.ppo.rollout_ranks import Serving, link_peers, named_link, serve
from klppo_train.ppo.rollouts import ColocatedRollouts
from klppo_train.runtime.engine import build_engine
from klppo_train.runtime.precision import resolve_precision
from klppo_train.runtime.process_group import START_UP_WAIT, rollout_link
from klppo_train.trainer.assemble import StepBuilder
from klppo_train.trainer.validation import validate
from rollout import recv_object, release_watch, send_object

log = logging.getLogger("klppo_train")


@dataclass
class _Side:
    """What :meth:`StepBuilder.sampled` reads of a run's components."""

    rollouts: ColocatedRollouts
    tokenizer: Any
    rewards: Any
    shaping: Any


@dataclass
class _Validating:
    """What validation reads (:class:`klppo_train.trainer.validation.Validated`): rule
    rewards only (a reward model is refused with rollout ranks)."""

    sampler: Any
    plan: Any
    tokenizer: Any
    rewards: Any
    reward_model: Any = None
    budgets: Any = None


class _Received:
    """A publisher that publishes nothing: the weights arrive from the training rank."""

    version = 0

    def sync(self, version: int) -> dict[str, float]:
        raise RuntimeError("a generating rank receives weights, it does not publish them")


def _last_step(trainer, batches_per_epoch: int) -> int:
    """The run's last step (``trainer.stop_at_step`` where it stops earlier)."""
    steps = total_steps(trainer, batches_per_epoch)
    return min(steps, trainer.stop_at_step or steps)


def generate(cfg: AppConfig, checked: Checked) -> dict:
    """Serve the training rank until it stops; an empty summary (rank 0 writes the run's)."""
    link = rollout_link()
    # the first order, from training rank 0 to each generating rank: after the training
    # ranks built their models and probed (no bound: the link's timeout starts once both
    # sides are up)
    with named_link(link_peers(link)):
        start = recv_object(link.group, 0, timeout=START_UP_WAIT)
    if start[0] == "stop":  # it failed before its first step
        for rank in link.served():
            release_watch(link.group, rank)
        dist.destroy_process_group()
        return {}
    model_dir = ensure_model_dir(cfg, Path(cfg.trainer.run_dir).expanduser())
    engine = build_engine(
        cfg, model_dir, checked.tokenizer, resolve_precision(cfg.model.dtype, default_device())
    )
    # up: the training ranks' first batch is timed from here (the sends' buffers are kept)
    up = [send_object(link.group, rank, "up") for rank in link.served()]
    builder = StepBuilder(cfg)
    sampler = builder.sampler(engine, checked.tokenizer, checked.tools)
    try:
        d = cfg.data
        loader = PromptLoader(checked.train, d.loader_batch_size, d.seed, d.shuffle)
        plan = builder.plan()
        colocated = ColocatedRollouts(
            engine, _Received(), plan, checked.tokenizer.pad_token_id, sampler,
            builder.rollout_stats(engine), sleeps=False,
        )  # fmt: skip
        side = _Side(colocated, checked.tokenizer, checked.rewards, builder.shaping())
        evaluation = _Validating(sampler, plan, checked.tokenizer, checked.rewards)
        items, size = checked.val.items, d.val_batch_size
        generations = cfg.trainer.log_val_generations
        log.info("generating rank: %d step(s) ahead of the training rank", cfg.async_training.lag)
        # A signal (torchrun forwards SIGTERM to every rank) is only recorded: the training
        # rank checkpoints at the step's end and needs this rank's batch until then.
        with Preemption() as preemption:
            source = builder.sampled(side, loader.next_batch)
            last = serve(
                Serving(
                    link, source, engine, loader,
                    lambda: validate(evaluation, items, size, generations),
                    cfg.async_training.lag, _last_step(cfg.trainer, len(loader)),
                    checked.rewards,
                    # dynamic sampling's ranks always re-split (their rounds differ)
                    cfg.trainer.balance_batch or cfg.algorithm.filter_groups.enable,
                ),
                start,
            )  # fmt: skip
            del up  # taken before the first batch
            if preemption.agreed():
                raise Preempted(last, preemption.signal_name)
    finally:
        sampler.close()
        engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return {}
