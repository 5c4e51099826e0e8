"""``ShardingConfig``: every FSDP lever in one frozen, validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads on first use of a dtype: a config is checked without it
    import torch

STRATEGIES = ("fsdp2", "fsdp1")


# Short names users know from verl recipes, and torch's own names.
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")


def dtype_name(value: str | torch.dtype | None, field: str) -> str | None:
    """The canonical name (``"bfloat16"``) of a dtype given as a name, a short name or a
    ``torch.dtype``; ``None`` stays ``None``."""
    if value is None:
        return None
    name = value if isinstance(value, str) else str(value).removeprefix("torch.")
    name = DTYPE_NAMES.get(name, name)
    if name not in FLOAT_DTYPES:
        raise ValueError(
            f"MixedPrecision.{field}={value!r}; valid: {', '.join([*FLOAT_DTYPES, *DTYPE_NAMES])}"
        )
    return name


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Dtypes FSDP uses, by name (so the config is plain YAML). ``None`` keeps the
    parameter's own dtype.

    Attributes:
        param_dtype: dtype of the unsharded parameters in forward/backward (bf16 on GPU).
        reduce_dtype: dtype of the gradient reduce-scatter (fp32 keeps sums exact).
        buffer_dtype: dtype of module buffers (rotary frequencies stay fp32).

    Each accepts ``"bfloat16"``, ``"bf16"``, ``torch.bfloat16``, ...; stored as the
    canonical name, read as a ``torch.dtype`` through :attr:`param`, :attr:`reduce`,
    :attr:`buffer`.
    """

    param_dtype: str | None = None
    reduce_dtype: str | None = None
    buffer_dtype: str | None = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            object.__setattr__(self, field, dtype_name(getattr(self, field), field))

    @property
    def param(self) -> torch.dtype | None:
        return _torch_dtype(self.param_dtype)

    @property
    def reduce(self) -> torch.dtype | None:
        return _torch_dtype(self.reduce_dtype)

    @property
    def buffer(self) -> torch.dtype | None:
        return _torch_dtype(self.buffer_dtype)


def _torch_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    import torch

    return getattr(torch, name)


GPU_DEFAULT_PRECISION = MixedPrecision(
    param_dtype="bfloat16", reduce_dtype="float32", buffer_dtype="float32"
)
# No native bf16 on most CPUs: bf16 FSDP ran 3-8x slower than fp32 on our CPU machines.
CPU_DEFAULT_PRECISION = MixedPrecision(
    param_dtype="float32", reduce_dtype="float32", buffer_dtype="float32"
)


@dataclass(frozen=True, kw_only=True)
class ShardingConfig:
    """How to shard one model (actor, critic or reference).

    Attributes:
        strategy: ``"fsdp2"`` (``fully_shard``, per-parameter DTensor sharding) or
            ``"fsdp1"`` (``FullyShardedDataParallel``, flat parameters).
        wrap_policy: class names of the modules that become shard units; ``None`` uses
            the model's ``_no_split_modules`` (its decoder layer class).
        min_num_params: instead of class names, make every module with at least this
            many (not yet wrapped) parameters a unit.
        reshard_after_forward: free unsharded parameters after forward (True), keep them
            for backward (False), or (FSDP2) reshard to this smaller group size (int).
        forward_prefetch: all-gather the next unit(s) while the current one computes;
            an int ≥ 1 is the prefetch depth (FSDP2).
        backward_prefetch: all-gather the previous unit during backward.
        param_offload: keep parameters on CPU between uses (FSDP1 ``CPUOffload``; FSDP2
            uses ``CPUOffloadPolicy``).
        optimizer_offload: keep optimizer states on CPU between steps (see
            :func:`offload_optimizer` / :func:`load_optimizer`).
        offload_policy: FSDP2 ``CPUOffloadPolicy`` (parameters, gradients and the optimizer
            step on CPU). FSDP2 only.
        mixed_precision: dtypes; ``None`` picks bf16/fp32/fp32 on GPU, fp32 on CPU.
        gradient_checkpointing: recompute each unit's activations in backward.
        activation_offload: move saved activations to CPU during forward.
        fsdp_size: ranks one model is sharded over; −1 = all. Smaller values build a 2-D
            (replicate × shard) mesh: hybrid sharding.
    """

    strategy: str = "fsdp2"
    wrap_policy: tuple[str, ...] | None = None
    min_num_params: int | None = None
    reshard_after_forward: bool | int = True
    forward_prefetch: bool | int = False
    backward_prefetch: bool = True
    param_offload: bool = False
    optimizer_offload: bool = False
    offload_policy: bool = False
    mixed_precision: MixedPrecision | None = None
    gradient_checkpointing: bool = False
    activation_offload: bool = False
    fsdp_size: int = -1

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"ShardingConfig.strategy={self.strategy!r}; valid: {', '.join(STRATEGIES)}"
            )
        if self.wrap_policy is not None and self.min_num_params is not None:
            raise ValueError(
                "ShardingConfig.wrap_policy and .min_num_params are exclusive; set one"
            )
        if self.min_num_params is not None and self.min_num_params < 1:
            raise ValueError(
                f"ShardingConfig.min_num_params must be >= 1, got {self.min_num_params}"
            )
        self._check_reshard_and_prefetch()
        if self.offload_policy and self.strategy != "fsdp2":
            raise ValueError(
                "ShardingConfig.offload_policy is an FSDP2 feature; strategy is 'fsdp1'"
            )
        if self.gradient_checkpointing and self.activation_offload:
            raise ValueError(
                "ShardingConfig.activation_offload with .gradient_checkpointing: checkpointing "
                "already drops the activations; enable one of them"
            )
        if self.fsdp_size == 0 or self.fsdp_size < -1:
            raise ValueError(f"ShardingConfig.fsdp_size must be -1 or >= 1, got {self.fsdp_size}")

    def _check_reshard_and_prefetch(self) -> None:
        reshard = self.reshard_after_forward
        if not isinstance(reshard, bool):
            if self.strategy == "fsdp1":
                raise ValueError("ShardingConfig.reshard_after_forward must be a bool for fsdp1")
            if not isinstance(reshard, int) or reshard < 1:
                raise ValueError(
                    "ShardingConfig.reshard_after_forward must be a bool or an int >= 1, "
                    f"got {reshard!r}"
                )
        prefetch = self.forward_prefetch
        if not isinstance(prefetch, bool) and (not isinstance(prefetch, int) or prefetch < 1):
            raise ValueError(
                f"ShardingConfig.forward_prefetch must be a bool or a depth >= 1, got {prefetch!r}"
            )

    @property
    def forward_prefetch_depth(self) -> int:
        """How many following units each unit prefetches in forward (0 = off)."""
        return int(self.forward_prefetch)

    def precision_for(self, device: torch.device) -> MixedPrecision:
        """The configured dtypes, or the per-device default."""
        if self.mixed_precision is not None:
            return self.mixed_precision
        return GPU_DEFAULT_PRECISION if device.type == "cuda" else CPU_DEFAULT_PRECISION
