"""klppo-fsdp-sharding: shard HF models with PyTorch FSDP2 or FSDP1.

- :class:`ShardingConfig`, :class:`MixedPrecision` and :func:`shard_model`
- memory levers: :func:`offload_model`, :func:`load_model`, :func:`offload_optimizer`,
  :func:`load_optimizer`; activation policies :class:`GradientCheckpointing`,
  :class:`ActivationOffload`
- :func:`clip_grad_norm`, :func:`iter_full_state_dict` (streamed full weights, HF names)
- :func:`save_checkpoint`, :func:`load_checkpoint` (DCP, atomic), :func:`export_hf`,
  :func:`published_dir` (a directory written by any rank, renamed into place at the end)
- :func:`write_manifest`, :func:`verify_manifest`: a checkpoint's files, sizes and CRC-32
- Ulysses sequence parallelism's pieces (:mod:`fsdp_sharding.ulysses`): :func:`ulysses_mesh`,
  :func:`pad_to_multiple`, :func:`sequence_slice`, :func:`seq_to_heads`,
  :func:`heads_to_seq`, :func:`repeat_kv_heads`, :func:`gather_sequence`
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("klppo-fsdp-sharding")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

# name → the submodule that defines it, imported on first use (PEP 562): a caller that
# needs one torch-free name (a config check) does not pay for torch.
_EXPORTS = {
    "ActivationOffload": "activations",
    "GradientCheckpointing": "activations",
    "MixedPrecision": "config",
    "ShardingConfig": "config",
    "build_mesh": "mesh",
    "choose_shard_units": "units",
    "clean_name": "activations",
    "clip_grad_norm": "grad",
    "default_device": "mesh",
    "export_hf": "checkpoint",
    "published_dir": "checkpoint",
    "iter_full_state_dict": "state",
    "load_checkpoint": "checkpoint",
    "write_manifest": "manifest",
    "verify_manifest": "manifest",
    "has_manifest": "manifest",
    "load_model": "memory",
    "load_optimizer": "memory",
    "offload_model": "memory",
    "offload_optimizer": "memory",
    "save_checkpoint": "checkpoint",
    "shard_model": "shard",
    "ulysses_mesh": "ulysses",
    "pad_to_multiple": "ulysses",
    "sequence_slice": "ulysses",
    "seq_to_heads": "ulysses",
    "heads_to_seq": "ulysses",
    "repeat_kv_heads": "ulysses",
    "gather_sequence": "ulysses",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value  # later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = list(_EXPORTS)
