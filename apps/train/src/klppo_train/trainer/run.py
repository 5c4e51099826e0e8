"""PPO as a task of the one run loop (:mod:`klppo_train.loop.run_loop`): :func:`train`.

Built (:meth:`PPOTask.build`): the components (sharded models, optimizers, engine, weight
sync), the prompt loader and the LR schedulers. At the start the token budgets come from a
checkpoint or the config (``auto`` ones probed, :mod:`klppo_train.trainer.probe`); a
resumed run syncs its weights into the engine, a fresh one with
``reward_model.normalize=reference`` measures the reward normalization. A step is
:func:`klppo_train.ppo.step.ppo_step` and the schedulers' step; validation greedy-answers
the held-out prompts; the export is the actor's HF directory.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from klppo_train.budgets.run_budgets import BUDGETS_FILE
from klppo_train.checks.preflight import Checked, preflight, validation_metrics
from klppo_train.config.schema import AppConfig
from klppo_train.data.datasets import PromptLoader
from klppo_train.loop.checkpoints import BudgetsInForce, RNGStates, Stateful
from klppo_train.loop.report import PLOTTED
from klppo_train.loop.run_dir import run_task, total_steps
from klppo_train.ppo.components import Components
from klppo_train.ppo.rollout_ranks import RemoteRollouts
from klppo_train.ppo.rollouts_ahead import (
    RESUME_ASYNC,
    RESUME_COLOCATED,
    NothingAhead,
    RolloutsAhead,
)
from klppo_train.ppo.step import calibrate_reward_model, ppo_step
from klppo_train.runtime.launch import launch_world_size
from klppo_train.runtime.process_group import init_distributed, is_main, rollout_link
from klppo_train.tracking.metrics_log import SHOWN
from klppo_train.trainer.assemble import StepBuilder
from klppo_train.trainer.build import build_components
from klppo_train.trainer.generating_rank import generate
from klppo_train.trainer.probe import ProbeShape, choose_budgets
from klppo_train.trainer.validation import validate

log = logging.getLogger("klppo_train")


def train(cfg: AppConfig, checked: Checked | None = None) -> dict:
    """Run the configured PPO steps under the one loop (resuming if asked); return the
    summary. ``checked``: what :func:`klppo_train.checks.preflight.preflight` returned (run
    here when not given). Engine and process group are closed however the run ends."""
    checked = checked or preflight(cfg, launch_world_size())
    if cfg.async_training.rollout_ranks:  # the world splits into training and generating ranks
        init_distributed(cfg.trainer.collective_timeout_s, cfg.async_training.rollout_ranks)
        if rollout_link().generates:
            return generate(cfg, checked)
    return run_task(cfg, lambda model_dir: PPOTask.build(cfg, checked, model_dir))


def _token_budgets(c: Components, configured: dict, shape: ProbeShape, run_dir: Path) -> None:
    """A checkpoint's budgets, else the ``configured`` ones with ``auto`` ones probed (in
    ``shape``); in ``run_dir/budgets.json`` (rank 0)."""
    path = run_dir / BUDGETS_FILE if is_main() else None
    if c.budgets is None:
        c.budgets = choose_budgets(c, configured, shape, path)
    else:
        c.budgets.path = path
        c.budgets.write()
        log.info("token budgets from the checkpoint: %s", c.budgets.tokens)


NORMALIZATION_FILE = "reward_normalization.json"  # in the run directory


def _calibrate(c: Components, items, run_dir: Path) -> None:
    """``reward_model.normalize=reference``: measured before step 1, kept in the run
    directory (and the checkpoints)."""
    found = calibrate_reward_model(c, items)
    log.info(
        "reward model normalized on %d reference samples: mean %.4f, std %.4f",
        found["samples"], found["mean"], found["std"],
    )  # fmt: skip
    if is_main():
        tmp = run_dir / (NORMALIZATION_FILE + ".tmp")
        tmp.write_text(json.dumps(found, indent=2))
        os.replace(tmp, run_dir / NORMALIZATION_FILE)


def _nothing_ahead(c: Components) -> NothingAhead:
    """What a run that saves nothing in flight says of a checkpoint that holds some."""
    split = isinstance(c.rollouts, RemoteRollouts)
    return NothingAhead(RESUME_COLOCATED if split else RESUME_ASYNC)


@dataclass
class PPOTask:
    """PPO as a task of :mod:`klppo_train.loop.run_loop`: a step is :func:`ppo_step` on the
    loader's next batch and the LR schedulers' step; validation is the held-out prompts'
    greedy answers; the export is the actor's. Built from the config once (:meth:`build`)."""

    c: Components
    configured_budgets: dict[str, int | str]  # each role's, as the config gives it
    shape: ProbeShape  # what the probe of ``auto`` budgets measures
    loader: PromptLoader
    schedulers: list
    total_steps: int
    train_items: list
    val_items: list
    val_batch_size: int
    generations: int
    best_metric: str | None  # trainer.best_metric=auto's choice (validation_metrics' first)
    best_export: str = "actor_hf_best"
    label: str = "PPO"
    shown: dict = field(default_factory=lambda: dict(SHOWN))
    panels: tuple = PLOTTED

    @classmethod
    def build(cls, cfg: AppConfig, checked: Checked, model_dir: Path) -> PPOTask:
        """The run's components around the checked tokenizers and rewards (a collective:
        sharding, engine start), its loader and schedulers."""
        c = build_components(
            cfg, model_dir, checked.tokenizer, checked.rewards, checked.rm_tokenizer,
            checked.tools,
        )  # fmt: skip
        try:
            d = cfg.data
            loader = PromptLoader(checked.train, d.loader_batch_size, d.seed, d.shuffle)
            steps = total_steps(cfg.trainer, len(loader))
            builder = StepBuilder(cfg)
            link = rollout_link()
            c.rollouts = (
                RemoteRollouts(link, c.weight_sync, loader, cfg.async_training.lag, c.rewards)
                if link
                else builder.sampled_prompts(c, loader.next_batch, steps, checked.train.items)
            )
            found = validation_metrics(checked.val, checked.rewards, cfg.reward_model.enable)
            return cls(
                c, builder.configured_budgets(), builder.probe_shape(), loader,
                builder.schedulers(c, steps), steps, checked.train.items, checked.val.items,
                d.val_batch_size, cfg.trainer.log_val_generations, next(iter(found), None),
            )  # fmt: skip
        except BaseException:
            c.sampler.close()
            c.engine.close()  # the loop closes only a task that exists
            raise

    def trainees(self) -> list:
        return self.c.trainees()

    def states(self) -> dict[str, Stateful]:
        """Everything besides the trainees' models and optimizers that a resumed run
        needs, by the name it is saved under: each trainee's LR scheduler, the KL
        controller, the loader's position, the token budgets, the RNG states, the reward
        normalization in force and the batches generated ahead (``async_training``)."""
        c = self.c
        scheduled = zip(c.trainees(), self.schedulers, strict=True)
        lr = {f"lr_scheduler/{t.name}": s for t, s in scheduled}
        rm = {"reward_model": c.reward_model} if c.reward_model is not None else {}
        ahead = c.rollouts if isinstance(c.rollouts, RolloutsAhead) else _nothing_ahead(c)
        return {
            **lr,
            "kl_controller": c.kl_controller,
            "loader": self.loader,
            "budgets": BudgetsInForce(c),
            "rng": RNGStates(),
            **rm,
            "rollouts_ahead": ahead,
        }

    def start(self, first: int, run_dir: Path) -> None:
        """Token budgets; a resumed run's weights into the engine, a fresh one's reward
        normalization measured."""
        _token_budgets(self.c, self.configured_budgets, self.shape, run_dir)
        if first:
            self.c.rollouts.resume(first)
        elif self.c.reward_model is not None and self.c.reward_model.normalize == "reference":
            _calibrate(self.c, self.train_items, run_dir)

    def step(self, step: int) -> dict[str, float]:
        metrics = ppo_step(self.c, self.loader.next_batch(), step)
        for scheduler in self.schedulers:
            scheduler.step()
        return metrics

    def validate(self, step: int) -> tuple[dict[str, float], list[dict]]:
        if isinstance(self.c.rollouts, RemoteRollouts):  # the engine is on the generating rank
            return self.c.rollouts.validate(step)
        return validate(self.c, self.val_items, self.val_batch_size, self.generations)

    def export(self, run_dir: Path) -> None:
        if self.c.export_actor is not None:
            self.c.export_actor(run_dir)

    def export_best(self, run_dir: Path) -> None:
        """``actor_hf_best`` (with LoRA also ``actor_lora_best``)."""
        if self.c.export_actor is not None:
            self.c.export_actor(run_dir, "_best")

    def close(self) -> None:
        if isinstance(self.c.rollouts, RemoteRollouts):
            self.c.rollouts.close()  # the generating rank stops
        self.c.sampler.close()  # the tools' threads
        self.c.engine.close()  # vLLM's shutdown destroys the default group; HF's does not
