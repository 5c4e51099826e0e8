"""klppo-fsdp-sharding: shard HF models with PyTorch FSDP2 or FSDP1.

- :class:`ShardingConfig`, :class:`MixedPrecision` and :func:`shard_model`
- memory levers: :func:`offload_model`, :func:`load_model`, :func:`offload_optimizer`,
  :func:`load_optimizer`; activation policies :class:`GradientCheckpointing`,
  :class:`ActivationOffload`
- :func:`clip_grad_norm`, :func:`iter_full_state_dict` (streamed full weights, HF names)
- :func:`save_checkpoint`, :func:`load_checkpoint` (DCP, atomic), :func:`export_hf`
"""

from importlib.metadata import PackageNotFoundError, version

from fsdp_sharding.activations import ActivationOffload, GradientCheckpointing, clean_name
from fsdp_sharding.checkpoint import export_hf, load_checkpoint, save_checkpoint
from fsdp_sharding.config import MixedPrecision, ShardingConfig
from fsdp_sharding.grad import clip_grad_norm
from fsdp_sharding.memory import load_model, load_optimizer, offload_model, offload_optimizer
from fsdp_sharding.mesh import build_mesh, default_device
from fsdp_sharding.shard import shard_model
from fsdp_sharding.state import iter_full_state_dict
from fsdp_sharding.units import choose_shard_units

try:
    __version__ = version("klppo-fsdp-sharding")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "ActivationOffload",
    "GradientCheckpointing",
    "MixedPrecision",
    "ShardingConfig",
    "build_mesh",
    "choose_shard_units",
    "clean_name",
    "clip_grad_norm",
    "default_device",
    "export_hf",
    "iter_full_state_dict",
    "load_checkpoint",
    "load_model",
    "load_optimizer",
    "offload_model",
    "offload_optimizer",
    "save_checkpoint",
    "shard_model",
]
