"""The training run: steps of PPO over the prompt loader, validation, metrics on disk."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from klppo_train.build import build_components, ensure_embedded_data, make_schedulers
from klppo_train.config import AppConfig, to_yaml
from klppo_train.data import PromptLoader
from klppo_train.step import Components, ppo_step
from klppo_train.validate import sampling_config

log = logging.getLogger("klppo_train")


def validation_accuracy(c: Components, items, cfg: AppConfig) -> dict[str, float]:
    """Greedy (``rollout.val_temperature``) accuracy per data source: ``val/<source>/acc``."""
    sampling = sampling_config(cfg, validation=True)
    batch = c.engine.generate([list(i.prompt_ids) for i in items], sampling)
    hits: dict[str, list[float]] = {}
    for sample in batch.samples:
        item = items[sample.prompt_index]
        text = c.tokenizer.decode(list(sample.response_token_ids), skip_special_tokens=True)
        score = c.rewards.score(item.data_source, text, item.ground_truth, item.extra_info)
        hits.setdefault(item.data_source, []).append(float(score >= 1.0))
    return {f"val/{source}/acc": sum(v) / len(v) for source, v in hits.items()}


def total_steps(cfg: AppConfig, batches_per_epoch: int) -> int:
    return cfg.trainer.total_training_steps or cfg.trainer.total_epochs * batches_per_epoch


def append_jsonl(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def train(cfg: AppConfig) -> dict[str, float]:
    """Run the configured number of PPO steps; return the summary."""
    run_dir = Path(cfg.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    torch.manual_seed(cfg.trainer.seed)
    if not cfg.model.path:
        ensure_embedded_data(cfg)
    start = time.perf_counter()
    components, train_set, val_set = build_components(cfg, run_dir)
    loader = PromptLoader(
        train_set, cfg.data.train_batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle
    )
    steps = total_steps(cfg, len(loader))
    schedulers = make_schedulers(components, cfg, steps)
    metrics_path = run_dir / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    first = validation_accuracy(components, val_set.items, cfg)
    append_jsonl(metrics_path, {"step": 0, **first})
    log.info("step 0: %s", first)
    last = first
    for step in range(1, steps + 1):
        metrics = ppo_step(components, loader.next_batch(), cfg, step=step, version=step)
        for scheduler in schedulers:
            scheduler.step()
        if cfg.trainer.test_freq and (step % cfg.trainer.test_freq == 0 or step == steps):
            last = validation_accuracy(components, val_set.items, cfg)
            metrics.update(last)
        append_jsonl(metrics_path, {"step": step, **metrics})
        log.info(
            "step %d/%d score %.3f kl %.4f %s",
            step,
            steps,
            metrics["critic/score/mean"],
            metrics.get("actor/reward_kl_penalty", 0.0),
            " ".join(f"{k}={v:.3f}" for k, v in last.items()),
        )
    summary = {
        "minutes": (time.perf_counter() - start) / 60,
        "steps": steps,
        **{f"first_{k}": v for k, v in first.items()},
        **{f"final_{k}": v for k, v in last.items()},
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
