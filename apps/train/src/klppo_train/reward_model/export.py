"""Making a reward model's HF directory (:mod:`klppo_train.reward_model.hf_dir`): the
scalar head's config and initialisation, the export.

The pad token: when the tokenizer pads with EOS (SmolLM2 does), transformers' sequence
classifier reads "the last token that is not padding" and so the token *before* a final EOS
(TRL's long-standing bug). The exported tokenizer and config pad with another special token
then, so that reading is the token klppo trained and scores at.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig

from fsdp_sharding import export_hf
from klppo_train.runtime.process_group import barrier, is_main

log = logging.getLogger("klppo_train")


def scalar_head_config(path: Path):
    """The model's config as a one-label token classifier with a bias-free head, no
    dropout."""
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.token_classification_bias = False
    config.classifier_dropout = 0.0
    return config


def init_score_head(model, seed: int) -> None:
    """A fresh head, N(0, 1/(H + 1)) as OpenRLHF draws it, from ``seed`` (every rank alike)."""
    weight = model.score.weight
    generator = torch.Generator().manual_seed(seed)
    fresh = torch.randn(weight.shape, generator=generator) / (weight.shape[1] + 1)
    with torch.no_grad():
        weight.copy_(fresh.to(weight.dtype))


def _distinct_pad(tokenizer) -> int | None:
    """A special token to pad with when the tokenizer pads with EOS (None: keep its pad)."""
    if tokenizer.pad_token_id not in (None, tokenizer.eos_token_id):
        return None
    for token_id in tokenizer.all_special_ids:
        if token_id != tokenizer.eos_token_id:
            return token_id
    return None


def export_reward_model(model, tokenizer, path: Path, mean: float, std: float) -> None:
    """Write ``path`` as an ``AutoModelForSequenceClassification`` directory with the
    scores' ``mean``/``std`` (a collective; rank 0 writes; published by one rename)."""
    tmp = path.with_name(path.name + ".export")
    export_hf(model, None, tmp)
    if is_main():
        hf_model = getattr(model, "module", model)
        config_file = tmp / "config.json"
        config = json.loads(config_file.read_text())
        token_class = next(  # the transformers class under FSDP2's FSDP<name> subclass
            c.__name__ for c in type(hf_model).__mro__ if c.__module__.startswith("transformers")
        )
        arch = token_class.replace("ForTokenClassification", "ForSequenceClassification")
        config.update(architectures=[arch], mean=mean, std=std, num_labels=1)
        pad = _distinct_pad(tokenizer)
        if pad is not None:
            tokenizer = _with_pad(tokenizer, pad)
            config["pad_token_id"] = pad
        config_file.write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(str(tmp))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        log.info("reward model: %s (scores mean %.3f, std %.3f)", path, mean, std)
    barrier()


def _with_pad(tokenizer, pad_id: int):
    import copy

    padded = copy.deepcopy(tokenizer)
    padded.pad_token = padded.convert_ids_to_tokens(pad_id)
    return padded
