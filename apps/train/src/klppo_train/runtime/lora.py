"""LoRA on the actor (``model.lora_rank > 0``) and the critic's backbone
(``critic.lora_rank > 0``, its value head trained in full), through peft.

The actor is the base model with peft's LoRA layers on ``model.target_modules``: the base
is frozen and stored in the compute dtype (no fp32 masters, gradients or AdamW state for
weights that never change), the adapters train in fp32 (``B`` starts at zero: step 0's
policy is exactly the base). The reference policy is the same sharded model with its
adapters switched off (:class:`WithoutAdapters`: no second copy, no second FSDP wrap);
the weight sync sends only the adapters (:class:`rollout.AdapterSync`); checkpoints hold
the adapters and their optimizer state; the final export writes the merged model
(``actor_hf``) and the adapter in peft's format (``actor_lora``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

ADAPTER_DIR = "actor_lora"


@dataclass(frozen=True)
class Lora:
    """A model's adapters: ``rank`` r, ``alpha`` α (the update is ``(α/r)·B·A``), the
    ``target_modules`` (peft's names; ``all-linear``: every linear layer but the LM head)
    and the modules ``trained`` in full instead (a critic's value head)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    trained: tuple[str, ...] = ()

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def peft_config(self):
        from peft import LoraConfig

        targets = self.target_modules
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            target_modules="all-linear" if targets == ("all-linear",) else list(targets),
            lora_dropout=0.0,
            bias="none",
            exclude_modules=list(self.trained) or None,
        )

    def apply(self, model: nn.Module) -> nn.Module:
        """``model`` (frozen as it is) with adapters on the target modules and the
        ``trained`` modules unfrozen, every trained parameter in fp32."""
        from peft import get_peft_model

        peft_model = get_peft_model(model, self.peft_config())
        for name in self.trained:
            peft_model.get_base_model().get_submodule(name).requires_grad_(True)
        for param in peft_model.parameters():
            if param.requires_grad:
                param.data = param.data.float()
        return peft_model


def lora_of(section: Any, trained: tuple[str, ...] = ()) -> Lora | None:
    """A config section's ``lora_rank``/``lora_alpha``/``target_modules`` (``model.*``,
    ``critic.*``) as a :class:`Lora`, None at rank 0."""
    if not section.lora_rank:
        return None
    return Lora(section.lora_rank, section.lora_alpha, section.target_modules, trained)


def check_targets(lora: Lora, model_dir: Path) -> None:
    """ValueError unless every name in ``target_modules`` matches a linear layer of the model
    of ``model_dir``'s config.json (peft's rule: the module's name, or its last parts), and
    none is an output head tied to the input embedding (the merge has no weight of its own
    to change). The model is built on the meta device: no weights are read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    tied_head = model.config.tie_word_embeddings and model.get_output_embeddings()
    tied = {n for n, m in model.named_modules() if tied_head is not None and m is tied_head}
    for target in lora.target_modules:
        if target == "all-linear":
            continue
        found = [n for n in linear if n == target or n.endswith(f".{target}")]
        if not found:
            names = sorted({n.rsplit(".", 1)[-1] for n in linear})
            raise ValueError(f"{target!r} names no linear layer of the model (it has {names})")
        if tied & set(found):
            raise ValueError(f"{target!r} is the output head, tied to the input embedding")


class WithoutAdapters(nn.Module):
    """A LoRA model with its adapters switched off for every forward: the base model (the
    reference policy), sharing the actor's sharded weights. The actor is not registered as
    a submodule, so nothing done to this module (``eval()``) reaches the actor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.__dict__["peft_model"] = model

    @property
    def config(self):
        return self.peft_model.config

    def forward(self, *args, **kwargs):
        trained = [p for p in self.peft_model.parameters() if p.requires_grad]
        with self.peft_model.disable_adapter():
            # peft's switch also turns the adapters' requires_grad off, and FSDP2 fixes each
            # unit's gradient dtypes from requires_grad at the model's first forward: were
            # that this one (GRPO: no old-log-prob pass before the reference's), the fp32
            # adapters' gradients would be reduced in bf16 and refused. The flag changes
            # nothing here otherwise (no grad); peft turns it back on at the exit.
            for param in trained:
                param.requires_grad_(True)
            return self.peft_model(*args, **kwargs)


def export_lora(
    model: nn.Module, lora: Lora, base_dir: Path, tokenizer, run_dir: Path, suffix: str = ""
) -> None:
    """The export of a LoRA actor (a collective: the adapters are gathered on every rank):
    ``actor_hf<suffix>``, the merged model (``W + (α/r)·B·A`` on the base weights as stored
    in ``base_dir``, each tensor in their dtype), and ``actor_lora<suffix>``, the adapter in
    peft's format (``PeftModel.from_pretrained(base, actor_lora)``)."""
    from fsdp_sharding import iter_full_state_dict, published_dir
    from rollout import BaseWeights, adapter_pairs, merged_weights

    main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    adapters = {n: t.cpu() for n, t in iter_full_state_dict(model, trainable_only=True)}
    with published_dir(run_dir / f"actor_hf{suffix}") as tmp:
        if main:
            pairs = adapter_pairs(adapters.items())
            state = dict(merged_weights(pairs, BaseWeights(base_dir), lora.scaling))
            model.get_base_model().save_pretrained(str(tmp), state_dict=state)
            tokenizer.save_pretrained(str(tmp))
    with published_dir(run_dir / f"{ADAPTER_DIR}{suffix}") as tmp:
        if main:
            model.save_pretrained(str(tmp), state_dict=adapters)
