"""clip_grad_norm on a plain module: the norm, the clipping, and the non-finite case."""

import math

import torch
from torch import nn

from fsdp_sharding import clip_grad_norm


def module_with_grads(*grads: list[float]) -> nn.Module:
    module = nn.ParameterList([nn.Parameter(torch.zeros(len(g))) for g in grads])
    for p, g in zip(module, grads, strict=True):
        p.grad = torch.tensor(g)
    return module


def test_norm_and_clipping() -> None:
    module = module_with_grads([3.0, 0.0], [4.0])  # ‖g‖ = 5
    norm = clip_grad_norm(module, max_norm=1.0)
    assert norm.item() == 5.0
    clipped = torch.cat([p.grad for p in module])
    assert math.isclose(clipped.norm().item(), 1.0, rel_tol=1e-5)


def test_non_finite_norm_leaves_gradients_alone() -> None:
    module = module_with_grads([float("inf"), 1.0])
    norm = clip_grad_norm(module, max_norm=1.0)
    assert not torch.isfinite(norm)
    assert module[0].grad.tolist() == [float("inf"), 1.0]
