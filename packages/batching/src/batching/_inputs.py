"""Input normalisation shared by the planners (lists, numpy arrays and tensors all accepted)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def as_lengths(seq_lens: Sequence[int], name: str = "seq_lens") -> list[int]:
    """Token counts as Python ints; raise naming the first negative one."""
    values = seq_lens.tolist() if hasattr(seq_lens, "tolist") else list(seq_lens)
    lens = [int(n) for n in values]
    for i, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"`{name}[{i}]` = {n} is negative")
    return lens


def as_workloads(workloads: Sequence[float], name: str = "workloads") -> list[float]:
    """Workloads as floats; raise naming the first negative or non-finite one."""
    values = workloads.tolist() if hasattr(workloads, "tolist") else list(workloads)
    out = [float(w) for w in values]
    for i, w in enumerate(out):
        if not (math.isfinite(w) and w >= 0):
            raise ValueError(f"`{name}[{i}]` = {w} must be a finite number >= 0")
    return out
