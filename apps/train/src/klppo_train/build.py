"""Build every component of a run from the config, in one place (constructor injection).

Single process for now: the models are plain modules (sharding with ``fsdp_sharding`` and
torchrun come next). The embedded default (``model.path`` empty) generates its arithmetic
data and warms up its tiny model once, caching both in the run directory.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from klppo_train.algorithm import make_kl_controller
from klppo_train.config import AppConfig
from klppo_train.data import PromptDataset, read_rows, write_parquet
from klppo_train.embedded import (
    build_model,
    build_tokenizer,
    load_tokenizer,
    save_atomically,
    warm_up,
)
from klppo_train.rewards import RewardManager
from klppo_train.schedule import make_scheduler
from klppo_train.step import Components
from klppo_train.tasks import make_arithmetic_rows

log = logging.getLogger("klppo_train")


def ensure_embedded_data(cfg: AppConfig) -> None:
    """Write the arithmetic task's parquet files where the recipe expects them (once)."""
    for files, n, seed in ((cfg.data.train_files, 2000, 0), (cfg.data.val_files, 200, 1)):
        for path in map(Path, files):
            if not path.exists():
                write_parquet(make_arithmetic_rows(n, seed=seed), path)
                log.info("wrote %d arithmetic rows to %s", n, path)


def ensure_model_dir(cfg: AppConfig, run_dir: Path) -> Path:
    """The HF directory of the actor: the recipe's, or the embedded model (built, warmed up
    and cached in ``run_dir/model``)."""
    if cfg.model.path:
        return Path(cfg.model.path).expanduser()
    path = run_dir / "model"
    if (path / "config.json").exists():
        return path
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), seed=cfg.trainer.seed)
    rows = read_rows(cfg.data.train_files)
    losses = warm_up(model, tokenizer, rows, cfg.model.warmup_steps, seed=cfg.trainer.seed)
    log.info(
        "embedded model: %d warm-up steps, loss %.3f → %.3f",
        len(losses),
        losses[0] if losses else float("nan"),
        losses[-1] if losses else float("nan"),
    )
    return save_atomically(model, tokenizer, path)


def _engine(cfg: AppConfig, model_dir: Path, tokenizer):
    if cfg.rollout.engine == "hf":
        from rollout import HFEngine, HFEngineConfig

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return HFEngine(
            model,
            HFEngineConfig(
                pad_token_id=tokenizer.pad_token_id, eos_token_ids=(tokenizer.eos_token_id,)
            ),
        )
    from rollout import VLLMConfig, VLLMEngine

    return VLLMEngine(
        model_dir,
        VLLMConfig(
            max_model_len=cfg.data.max_prompt_length + cfg.rollout.response_length,
            kv_cache_space_gib=cfg.rollout.kv_cache_space_gib,
            max_num_seqs=cfg.rollout.max_num_seqs,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            enforce_eager=cfg.rollout.enforce_eager,
            seed=cfg.trainer.seed,
        ),
    )


def make_schedulers(c: Components, cfg: AppConfig, total_steps: int) -> list:
    """Actor: warm-up then constant/cosine; critic: warm-up then constant."""
    schedulers = [
        make_scheduler(
            c.actor_optimizer,
            warmup_steps=cfg.actor.lr_warmup_steps,
            total_steps=total_steps,
            kind=cfg.actor.lr_scheduler,
        )
    ]
    if c.critic_optimizer is not None:
        schedulers.append(
            make_scheduler(
                c.critic_optimizer,
                total_steps=total_steps,
                warmup_steps=cfg.critic.lr_warmup_steps,
                kind="constant",
            )
        )
    return schedulers


def build_components(cfg: AppConfig, run_dir: Path):
    """``(components, train_dataset, val_dataset)``."""
    model_dir = ensure_model_dir(cfg, run_dir)
    tokenizer = (
        AutoTokenizer.from_pretrained(model_dir) if cfg.model.path else load_tokenizer(model_dir)
    )
    train = PromptDataset(read_rows(cfg.data.train_files), tokenizer, cfg.data)
    val = PromptDataset(read_rows(cfg.data.val_files), tokenizer, cfg.data)
    actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref.requires_grad_(False)
    critic = critic_opt = None
    if cfg.critic.enable:
        # A value head on the actor's backbone; no dropout (the head defaults to 0.1).
        critic_config = AutoConfig.from_pretrained(model_dir, num_labels=1)
        critic_config.classifier_dropout = 0.0
        critic = AutoModelForTokenClassification.from_pretrained(
            model_dir, config=critic_config, dtype=torch.float32
        )
        critic_opt = torch.optim.AdamW(
            critic.parameters(), lr=cfg.critic.lr, weight_decay=cfg.critic.weight_decay
        )
    actor_opt = torch.optim.AdamW(
        actor.parameters(), lr=cfg.actor.lr, weight_decay=cfg.actor.weight_decay
    )
    components = Components(
        actor=actor,
        actor_optimizer=actor_opt,
        engine=_engine(cfg, model_dir, tokenizer),
        tokenizer=tokenizer,
        rewards=RewardManager(cfg.reward.custom or None, cfg.reward.strict),
        kl_controller=make_kl_controller(cfg.algorithm),
        ref=ref,
        critic=critic,
        critic_optimizer=critic_opt,
    )
    return components, train, val
