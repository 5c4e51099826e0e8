"""Token-budget micro-batches with a hard cap ("dynamic batch size").

verl picks k = ceil(Σlen / budget) micro-batches and balances compute across them, which
treats the budget as a soft target: a micro-batch can exceed it, and that is an OOM
the user cannot explain. Here the budget is a hard cap on the sum of the *effective*
(unpadded) lengths in every micro-batch:

1. k starts at max(ceil(Σlen / max_tokens), min_num_micro_batches);
2. k is feasible if "least-loaded micro-batch that still has room" (greedy LPT with the
   cap) packs every sequence, or, from the count first-fit-decreasing opens on its own
   upwards, if first-fit-decreasing does (it always succeeds there, so the search ends);
3. at the first feasible k, a Karmarkar–Karp partition of the workloads is used if it
   respects the cap (best balance); otherwise the feasible packing, evened out by moving
   sequences from the heaviest to the lightest micro-batch within the cap.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from batching._inputs import as_lengths
from batching.partition import balanced_partitions

COMPUTE_LINEAR_COEFF = 24576.0
"""``a`` in the compute workload a·L + L² of a sequence of length L.

Per layer a transformer spends ≈ 24·h²·L FLOPs in its dense projections and ≈ 4·h·L² in
attention, so compute ∝ 6h·L + L²; 24576 = 6 · 4096 (a 7B-class hidden size, the value
verl uses). A smaller model has a smaller ``a`` — the L² term then matters more."""

WORKLOADS = ("tokens", "compute")


def sequence_workloads(
    seq_lens: Sequence[int], workload: str = "compute", linear_coeff: float = COMPUTE_LINEAR_COEFF
) -> list[float]:
    """Per-sequence cost for balancing: L (``"tokens"``) or a·L + L² (``"compute"``)."""
    if workload == "tokens":
        return [float(n) for n in seq_lens]
    if workload == "compute":
        return [linear_coeff * n + float(n) * n for n in seq_lens]
    raise ValueError(f"unknown workload {workload!r}; valid: {', '.join(WORKLOADS)}")


@dataclass(frozen=True)
class MicroBatchPlan:
    """Which sequences go into which micro-batch.

    Attributes:
        micro_batches: one tuple of sequence indices (ascending) per micro-batch.
        inverse: ``inverse[i]`` is the row of sequence i in the micro-batches' outputs
            concatenated in plan order (see :func:`restore_order`).
        token_sums: effective tokens per micro-batch, each ≤ ``max_tokens``.
        max_tokens: the cap the plan was made for.
    """

    micro_batches: tuple[tuple[int, ...], ...]
    inverse: tuple[int, ...]
    token_sums: tuple[int, ...]
    max_tokens: int

    def __len__(self) -> int:
        return len(self.micro_batches)


def check_lengths(seq_lens, max_tokens: int) -> list[int]:
    lens = as_lengths(seq_lens)
    if not lens:
        raise ValueError("`seq_lens` is empty: there is nothing to split into micro-batches")
    if max_tokens < 1:
        raise ValueError(f"`max_tokens` must be >= 1, got {max_tokens}")
    for i, n in enumerate(lens):
        if n > max_tokens:
            raise ValueError(
                f"sequence {i} has {n} tokens, more than the micro-batch budget "
                f"max_tokens={max_tokens}; raise the budget or truncate the sequence"
            )
    return lens


def _fits(parts: list[list[int]], lens: list[int], max_tokens: int) -> bool:
    return all(sum(lens[i] for i in part) <= max_tokens for part in parts)


def _least_loaded_fit(order, lens, weights, k, max_tokens) -> list[list[int]] | None:
    """Each item (in ``order``) to the bin with the least workload that still has room."""
    parts, tokens = [[] for _ in range(k)], [0] * k
    heap = [(0.0, b) for b in range(k)]  # (load, bin)
    for i in order:
        skipped = []
        while heap and tokens[heap[0][1]] + lens[i] > max_tokens:
            skipped.append(heapq.heappop(heap))
        if not heap:
            return None
        load, b = heapq.heappop(heap)
        parts[b].append(i)
        tokens[b] += lens[i]
        heapq.heappush(heap, (load + weights[i], b))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return parts


def _first_fit(order, lens, k, max_tokens) -> list[list[int]] | None:
    """Each item (in ``order``) to the first bin with room."""
    parts, room = [[] for _ in range(k)], np.full(k, max_tokens, dtype=np.int64)
    for i in order:
        b = int(np.argmax(room >= lens[i]))
        if room[b] < lens[i]:
            return None
        parts[b].append(i)
        room[b] -= lens[i]
    return parts


def _longest_first(lens: list[int]) -> list[int]:
    return sorted(range(len(lens)), key=lambda i: (-lens[i], i))


def first_fit_decreasing_count(seq_lens: Sequence[int], max_tokens: int) -> int:
    """Micro-batches first-fit-decreasing opens with no limit on their number.

    Always feasible, so it bounds the count :func:`token_budget_micro_batches` returns;
    first fit into fewer bins always fails (it places items the same way until it runs out).
    """
    lens = check_lengths(seq_lens, max_tokens)
    parts = _first_fit(_longest_first(lens), lens, len(lens), max_tokens)
    return sum(1 for p in parts if p)


def _best_move(source, loads, heavy, light, light_empty, lens, weights, room):
    """The sequence of ``source`` whose move heavy → light lowers max(load) the most."""
    best = None
    for i in source:
        new_max = max(loads[heavy] - weights[i], loads[light] + weights[i])
        helps = new_max < loads[heavy] or light_empty
        if lens[i] <= room and helps and (best is None or new_max < best[0]):
            best = (new_max, i)
    return None if best is None else best[1]


def _even_out(parts, lens, weights, max_tokens, max_moves: int = 4096) -> list[list[int]]:
    """Move sequences from the heaviest to the lightest micro-batch while that lowers the
    heavier of the two (or fills an empty one) and the receiver stays within the cap."""
    parts = [list(p) for p in parts]
    loads = [sum(weights[i] for i in p) for p in parts]
    tokens = [sum(lens[i] for i in p) for p in parts]
    for _ in range(max_moves):
        heavy = max(range(len(parts)), key=lambda b: (loads[b], -b))
        light = min(range(len(parts)), key=lambda b: (len(parts[b]) > 0, loads[b], b))
        if heavy == light or len(parts[heavy]) < 2:
            break
        room = max_tokens - tokens[light]
        i = _best_move(parts[heavy], loads, heavy, light, not parts[light], lens, weights, room)
        if i is None:
            break
        parts[heavy].remove(i)
        parts[light].append(i)
        loads[heavy] -= weights[i]
        loads[light] += weights[i]
        tokens[heavy] -= lens[i]
        tokens[light] += lens[i]
    return parts


def _pack_into(k, lens, weights, max_tokens, ffd_count) -> list[list[int]] | None:
    """A cap-respecting packing of all sequences into exactly k non-empty micro-batches,
    or None if neither the least-loaded greedy nor first-fit-decreasing finds one."""
    heavy_first = sorted(range(len(lens)), key=lambda i: (-weights[i], i))
    parts = _least_loaded_fit(heavy_first, lens, weights, k, max_tokens)
    if parts is None and k >= ffd_count:
        parts = _first_fit(_longest_first(lens), lens, k, max_tokens)
    if parts is None:
        return None
    # KK balances best; use it whenever its partition happens to respect the cap.
    balanced = balanced_partitions(weights, k)
    if _fits(balanced, lens, max_tokens):
        return balanced
    parts = _even_out(parts, lens, weights, max_tokens)
    return parts if all(parts) else None


def _make_plan(parts: list[list[int]], lens: list[int], max_tokens: int) -> MicroBatchPlan:
    sums = [sum(lens[i] for i in p) for p in parts]
    return plan_from_parts(parts, len(lens), sums, max_tokens)


def plan_from_parts(
    parts: list[list[int]], n: int, token_sums: list[int], max_tokens: int
) -> MicroBatchPlan:
    """The :class:`MicroBatchPlan` of ``parts`` (sequence indices covering ``range(n)``, each
    part's tokens in ``token_sums``), in the plan's canonical order (by first sequence)."""
    ranked = sorted(zip((sorted(p) for p in parts), token_sums, strict=True), key=lambda x: x[0][0])
    inverse = [0] * n
    for row, i in enumerate(i for p, _ in ranked for i in p):
        inverse[i] = row
    micro_batches = tuple(tuple(p) for p, _ in ranked)
    return MicroBatchPlan(micro_batches, tuple(inverse), tuple(s for _, s in ranked), max_tokens)


def token_budget_micro_batches(
    seq_lens: Sequence[int] | torch.Tensor | np.ndarray,
    max_tokens: int,
    *,
    min_num_micro_batches: int = 1,
    num_micro_batches: int | None = None,
    workload: str = "compute",
) -> MicroBatchPlan:
    """Split sequences into as few micro-batches as this method finds, each ≤ ``max_tokens``.

    Args:
        seq_lens: ``[n]`` effective (unpadded) token counts, e.g. ``attention_mask.sum(-1)``.
        max_tokens: hard cap on the summed lengths of one micro-batch (per-GPU token budget).
        min_num_micro_batches: never use fewer (e.g. to keep a pipeline busy).
        num_micro_batches: use exactly this many (after :func:`sync_num_micro_batches`).
        workload: what to balance: ``"tokens"`` (L) or ``"compute"`` (a·L + L², see
            :data:`COMPUTE_LINEAR_COEFF`).

    Returns:
        A :class:`MicroBatchPlan` whose every micro-batch is non-empty and within the cap.

    Raises:
        ValueError: a sequence longer than ``max_tokens`` (naming its index and length), an
            empty batch, or a forced count that cannot respect the cap or exceeds n.
    """
    lens = check_lengths(seq_lens, max_tokens)
    weights = sequence_workloads(lens, workload)
    n = len(lens)
    if num_micro_batches is not None:
        return _forced_plan(num_micro_batches, lens, weights, max_tokens)
    lower = max(math.ceil(sum(lens) / max_tokens), min_num_micro_batches, 1)
    if lower > n:
        raise ValueError(f"min_num_micro_batches={min_num_micro_batches} exceeds the {n} sequences")
    ffd_count = first_fit_decreasing_count(lens, max_tokens)
    for k in range(lower, n + 1):
        parts = _pack_into(k, lens, weights, max_tokens, ffd_count)
        if parts is not None:
            return _make_plan(parts, lens, max_tokens)
    raise AssertionError("one sequence per micro-batch always fits")  # unreachable


def fixed_size_micro_batches(
    seq_lens: Sequence[int] | torch.Tensor | np.ndarray, micro_batch_size: int
) -> MicroBatchPlan:
    """verl's static mode (``use_dynamic_bsz=False``): consecutive micro-batches of
    ``micro_batch_size`` sequences in input order (the last may be smaller), whatever their
    lengths — no token cap, so ``plan.max_tokens`` is just the largest micro-batch's tokens.

    Args:
        seq_lens: ``[n]`` effective token counts (they only fill ``token_sums``).
        micro_batch_size: sequences per micro-batch, >= 1.

    Returns:
        A :class:`MicroBatchPlan` of ``ceil(n / micro_batch_size)`` micro-batches.
    """
    lens = as_lengths(seq_lens)
    if not lens:
        raise ValueError("`seq_lens` is empty: there is nothing to split into micro-batches")
    if micro_batch_size < 1:
        raise ValueError(f"`micro_batch_size` must be >= 1, got {micro_batch_size}")
    parts = [
        list(range(i, min(i + micro_batch_size, len(lens))))
        for i in range(0, len(lens), micro_batch_size)
    ]
    return _make_plan(parts, lens, max(sum(lens[i] for i in p) for p in parts))


def _forced_plan(k: int, lens: list[int], weights: list[float], max_tokens: int) -> MicroBatchPlan:
    if not 1 <= k <= len(lens):
        raise ValueError(
            f"`num_micro_batches`={k} must be between 1 and the number of sequences ({len(lens)})"
        )
    parts = _pack_into(k, lens, weights, max_tokens, first_fit_decreasing_count(lens, max_tokens))
    if parts is None:
        raise ValueError(
            f"cannot split {len(lens)} sequences ({sum(lens)} tokens) into {k} micro-batches "
            f"of at most {max_tokens} tokens each"
        )
    return _make_plan(parts, lens, max_tokens)


def restore_order(chunks: Sequence, plan: MicroBatchPlan):
    """Concatenate per-micro-batch outputs and put them back in the original order.

    Args:
        chunks: one output per micro-batch, in plan order: tensors ``[n_i, ...]`` (joined
            along dim 0) or lists of length n_i.
        plan: the plan the micro-batches came from.

    Returns:
        A tensor ``[n, ...]`` or a list of length n, row i belonging to sequence i.
    """
    if len(chunks) != len(plan):
        raise ValueError(f"got {len(chunks)} chunks for a plan of {len(plan)} micro-batches")
    for b, (chunk, members) in enumerate(zip(chunks, plan.micro_batches, strict=True)):
        if len(chunk) != len(members):
            raise ValueError(f"chunk {b} has {len(chunk)} rows, its micro-batch {len(members)}")
    if isinstance(chunks[0], torch.Tensor):
        joined = torch.cat(list(chunks), dim=0)
        return joined[torch.tensor(plan.inverse, device=joined.device)]
    joined = [row for chunk in chunks for row in chunk]
    return [joined[row] for row in plan.inverse]
