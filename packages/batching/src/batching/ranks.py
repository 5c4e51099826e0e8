"""Data-parallel balancing: give every rank the same number of sequences and similar tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from batching._inputs import as_lengths
from batching.partition import balanced_partitions


@dataclass(frozen=True)
class RankAssignment:
    """Sequences per data-parallel rank.

    Attributes:
        ranks: per rank, the sequence indices (ascending) it receives.
        loads: per rank, the sum of its sequences' lengths.
    """

    ranks: tuple[tuple[int, ...], ...]
    loads: tuple[int, ...]

    @property
    def min_load(self) -> int:
        return min(self.loads)

    @property
    def max_load(self) -> int:
        return max(self.loads)

    @property
    def mean_load(self) -> float:
        return sum(self.loads) / len(self.loads)

    @property
    def imbalance(self) -> float:
        """max / mean load (1.0 is perfect)."""
        return self.max_load / self.mean_load if self.mean_load else 1.0


def balance_across_ranks(seq_lens: Sequence[int], world_size: int) -> RankAssignment:
    """Reorder a global batch so each rank gets n / world_size sequences with balanced tokens.

    verl calls this ``balance_batch``: without it, the rank that happens to receive the
    long responses sets the pace for all. Uses KK with equal group sizes.

    Args:
        seq_lens: ``[n]`` effective token counts of the global batch.
        world_size: number of data-parallel ranks; must divide n.

    Returns:
        A :class:`RankAssignment` (its ``min_load``/``max_load``/``mean_load`` are the
        numbers to log).
    """
    lens = as_lengths(seq_lens)
    if world_size < 1:
        raise ValueError(f"`world_size` must be >= 1, got {world_size}")
    if len(lens) % world_size:
        raise ValueError(
            f"the batch of {len(lens)} sequences does not split evenly over "
            f"world_size={world_size} ranks"
        )
    parts = balanced_partitions(lens, world_size, equal_size=True)
    parts.sort(key=lambda p: p[0])
    return RankAssignment(
        tuple(tuple(p) for p in parts), tuple(sum(lens[i] for i in p) for p in parts)
    )
