"""Sharded checkpoints (torch.distributed.checkpoint) and HF export, written atomically.

Every save goes to a fresh temporary directory next to the target and is renamed into
place only after all ranks finished writing, so a crash mid-save leaves the previous
checkpoint untouched (the temporary directory is cleaned up on the next save).
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from fsdp_sharding.state import iter_full_state_dict

TMP_MARKER = ".tmp-"
EXTRA_FILE = "extra_state.pt"


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _shared_tmp_dir(path: Path) -> Path:
    """A temporary sibling of ``path`` with the same name on every rank."""
    token = [uuid.uuid4().hex if _is_main() else None]
    if dist.is_initialized():
        dist.broadcast_object_list(token, src=0)
    return path.with_name(f"{path.name}{TMP_MARKER}{token[0]}")


def _remove_stale_tmp_dirs(path: Path) -> None:
    for stale in path.parent.glob(f"{path.name}{TMP_MARKER}*"):
        shutil.rmtree(stale, ignore_errors=True)


def _publish(tmp: Path, path: Path) -> None:
    """Rank 0 swaps ``tmp`` into ``path`` (replacing an older checkpoint there)."""
    if _is_main():
        old = path.with_name(f"{path.name}{TMP_MARKER}old")
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: Optimizer | None = None,
    extra_state: dict[str, Any] | None = None,
    *,
    frozen: bool = True,
) -> Path:
    """Save model shards, optimizer state and ``extra_state`` on every rank (a collective).

    ``frozen=False`` leaves out the parameters that do not require grad (a LoRA model's
    base weights, which the model is rebuilt from): the checkpoint holds the adapters and
    their optimizer state only; load it with the same flag.

    ``extra_state`` (trainer step, KL controller, data position, ...) holds plain Python
    values and tensors; rank 0 writes it with ``torch.save`` and it loads with
    ``weights_only=True``.

    Returns:
        The checkpoint directory.
    """
    path = Path(path)
    if _is_main():
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp_dirs(path)
    _barrier()
    tmp = _shared_tmp_dir(path)
    options = _options(frozen)
    state = {"model": get_model_state_dict(model, options=options)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=options)
    dcp.save(state, checkpoint_id=str(tmp))
    if _is_main():
        torch.save(extra_state or {}, tmp / EXTRA_FILE)
    _barrier()
    _publish(tmp, path)
    return path


def _options(frozen: bool) -> StateDictOptions:
    return StateDictOptions(ignore_frozen_params=not frozen, strict=frozen)


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: Optimizer | None = None,
    *,
    frozen: bool = True,
) -> dict[str, Any]:
    """Load what :func:`save_checkpoint` wrote into an already sharded model (and optimizer);
    ``frozen`` as it was saved with.

    Returns:
        The ``extra_state`` that was saved.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {path}")
    options = _options(frozen)
    state = {"model": get_model_state_dict(model, options=options)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=options)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"], options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"], options=options)
    return torch.load(path / EXTRA_FILE, weights_only=True)


@contextmanager
def published_dir(path: str | Path) -> Iterator[Path]:
    """A temporary sibling of ``path`` (the same on every rank: a collective) to write into;
    once every rank leaves the block it replaces ``path`` (an older one there included). A
    crash inside leaves ``path`` as it was."""
    path = Path(path)
    tmp = _shared_tmp_dir(path)
    yield tmp
    _barrier()
    _publish(tmp, path)


def export_hf(model: nn.Module, tokenizer, path: str | Path) -> Path | None:
    """Write a HF directory (config, safetensors, tokenizer) from rank 0.

    The full weights are streamed (:func:`iter_full_state_dict`, a collective: every rank
    calls this) and only rank 0 keeps them. The model's own ``save_pretrained`` writes
    the files, so this package needs no HF import.

    Returns:
        The directory on rank 0, ``None`` elsewhere.
    """
    path = Path(path)
    state = {}
    for name, tensor in iter_full_state_dict(model):
        if _is_main():
            state[name] = tensor.cpu()
    with published_dir(path) as tmp:
        if _is_main():
            hf_model = getattr(model, "module", model)  # FSDP1 wraps; FSDP2 is the model itself
            hf_model.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
    return path if _is_main() else None
