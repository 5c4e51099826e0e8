"""HF model directories: load a saved tokenizer as it was saved, save a model atomically."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

PLAIN_BACKENDS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: Path):
    """The tokenizer saved in a HF model directory, as it was saved.

    A plain ``tokenizers`` backend (``tokenizer_class`` in tokenizer_config.json is
    ``TokenizersBackend`` / ``PreTrainedTokenizerFast``, e.g. the embedded character tokenizer,
    also after its export to ``actor_hf``) loads as that class; anything else via
    ``AutoTokenizer``. Not ``AutoTokenizer`` for all: in transformers 5 it maps a Qwen2
    directory to ``Qwen2Tokenizer`` by the model type, which drops the spaces our
    pre-tokenizer keeps — the model would then see other token ids than it was trained on
    (measured: val accuracy 5.5 % instead of ~24 %).
    """
    # transformers loads torch (seconds): imported here, once a tokenizer is needed.
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config_file = Path(path) / "tokenizer_config.json"
    saved_class = ""
    if config_file.is_file():
        saved_class = json.loads(config_file.read_text()).get("tokenizer_class", "")
    if saved_class in PLAIN_BACKENDS:
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def save_atomically(model, tokenizer, path: Path) -> Path:
    """``save_pretrained`` both into a temporary sibling, then rename into place."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return path
