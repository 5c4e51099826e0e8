"""Argument checks shared by the public functions.

They run before any math so that a wrong call fails with a message that names the
argument, instead of a broadcasting surprise three functions later.
"""

from __future__ import annotations

import torch


def check_same_shape(*named: tuple[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` unless every tensor has the shape of the first one.

    Args:
        named: ``(argument_name, tensor)`` pairs.
    """
    (first_name, first), *rest = named
    for name, tensor in rest:
        if tensor.shape != first.shape:
            raise ValueError(
                f"`{name}` has shape {tuple(tensor.shape)} but `{first_name}` has shape "
                f"{tuple(first.shape)}; they must match"
            )


def check_floating(*named: tuple[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` if a tensor is not floating point."""
    for name, tensor in named:
        if not torch.is_floating_point(tensor):
            raise ValueError(f"`{name}` must be a floating-point tensor, got dtype {tensor.dtype}")


def check_ndim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    """Raise ``ValueError`` unless ``tensor`` has ``ndim`` dimensions (``layout`` e.g. "[B, T]")."""
    if tensor.dim() != ndim:
        raise ValueError(
            f"`{name}` must have shape {layout}, got {tuple(tensor.shape)} ({tensor.dim()} dims)"
        )


def mask_as(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Return a 0/1 (or fractional) mask in the dtype of ``like`` for arithmetic."""
    return mask.to(dtype=like.dtype)
