"""The rollout engine and the sampling of each call, from the ``rollout`` section.

The section holds the package's own configs (``rollout.sampling``, ``rollout.vllm``,
``rollout.hf``); what the app derives is filled in here, once: the engine's maximum length
(``data.max_prompt_length`` + response length), its dtype (``model.dtype``), its seed and
the tokenizer's ids, and each call's sampling seed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM

from fsdp_sharding import default_device
from klppo_train.config.schema import AppConfig
from klppo_train.runtime.precision import Precision
from klppo_train.runtime.process_group import ROLLOUT_COUNTS
from rollout import HFEngine, RolloutEngine, SamplingConfig, VLLMEngine


def build_engine(cfg: AppConfig, model_dir: Path, tokenizer, precision: Precision) -> RolloutEngine:
    """The configured engine (``rollout.engine``) over ``model_dir`` in the compute dtype."""
    max_model_len = cfg.data.max_prompt_length + cfg.rollout.sampling.max_new_tokens
    if cfg.rollout.engine == "hf":
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=precision.dtype)
        model = model.to(default_device())
        config = replace(
            cfg.rollout.hf,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_ids=(tokenizer.eos_token_id,),
            max_model_len=max_model_len,
        )
        return HFEngine(model, config)
    config = replace(
        cfg.rollout.vllm, max_model_len=max_model_len, seed=cfg.trainer.seed, dtype=precision.name
    )
    return VLLMEngine(model_dir, config)


# A step's seed is trainer.seed * STRIDE + step (distinct while runs have fewer steps than
# this); its requests' are step seed * STRIDE + prompt index (while steps have fewer prompts).
STRIDE = 1_000_003


@dataclass(frozen=True)
class Sampling:
    """What each generate call samples with: ``rollout.sampling``, seeded per call from
    (``trainer.seed``, step), and greedy-or-``val_temperature`` validation."""

    config: SamplingConfig
    seed: int  # trainer.seed
    val_temperature: float = 0.0

    def _step_seed(self, step: int) -> int:
        return self.seed * STRIDE + step

    def for_step(self, step: int) -> SamplingConfig:
        """``rollout.sampling`` with this step's seed. The seed differs per step (one fixed
        seed would replay the same random draws every step) and is a function of
        (``trainer.seed``, step) so a resumed run samples exactly what an uninterrupted one
        would."""
        return replace(self.config, seed=self._step_seed(step))

    def for_validation(self) -> SamplingConfig:
        """One greedy (``rollout.val_temperature``) sample per prompt."""
        validation = replace(self.config, n=1, temperature=self.val_temperature)
        return replace(validation, seed=self._step_seed(0))

    def for_baseline(self, step: int) -> SamplingConfig:
        """One greedy sample per prompt at this step (ReMax's baseline: verl's
        ``do_sample=False``), whatever ``rollout.val_temperature`` says."""
        return replace(self.config, n=1, temperature=0.0, seed=self._step_seed(step))

    def request_seeds(self, step: int, prompts: range) -> list[int]:
        """One seed per prompt of the step, from (``trainer.seed``, step, the prompt's index
        in the whole step's batch): every request draws its own random stream (one seed for
        all gave duplicate prompts identical samples), and a prompt gets the same samples
        whichever rank generates it, so the samples do not change with the world size."""
        base = self._step_seed(step) * STRIDE
        return [base + index for index in prompts]


@dataclass
class RolloutStats:
    """vLLM's counters (``rollout.engine=vllm``, ``rollout.disable_log_stats=false``) as a
    step's metrics: the engine's cumulative counts (``rollout.vllm_engine.VLLM_STATS``) read
    before and after the step's generation. Over ranks the counts add up
    (``ROLLOUT_COUNTS``); the hit rate is the mean of the ranks' (each rank has its own
    engine and cache)."""

    engine: Any

    def counts(self) -> dict[str, float]:
        return self.engine.stats()

    def since(self, before: dict[str, float]) -> dict[str, float]:
        """``rollout/<counter>`` deltas since ``before`` and the prefix-cache hit rate of the
        generation. (vLLM's KV-cache usage gauge is not among them: read after a generation
        it is that of its last scheduler step, when every request has finished — 0.0.)"""
        now = self.engine.stats()
        out = {f"rollout/{k}": float(now.get(k, 0.0) - before.get(k, 0.0)) for k in ROLLOUT_COUNTS}
        queries = out["rollout/prefix_cache_queries"]
        hits = out["rollout/prefix_cache_hits"]
        out["rollout/prefix_cache_hit_rate"] = hits / queries if queries else 0.0
        return out
