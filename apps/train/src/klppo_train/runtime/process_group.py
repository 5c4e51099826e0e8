"""torch.distributed for the app: one process group, data-parallel splits, metric reduction.

Under ``torchrun`` the group comes from its environment (NCCL on GPUs, gloo on CPU). A plain
single process gets a 1-rank group (NCCL on its GPU where there is one, else gloo), so FSDP
sharding, weight sync and checkpoints run the same code at world size 1. Every rank hosts its
own rollout engine and works on its own slice of each batch; the losses' global token counts
(``klppo_train.update``) and FSDP's gradient reduction make the update the same as one
process on the whole batch.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
_HOST_GROUP: Any = None  # gloo beside NCCL: host-side agreements without a device sync
# The ranks that hold different data: ``(group, rank, size)``; None: every rank (no sequence
# parallelism). With Ulysses (klppo_train.runtime.sequence_parallel) the sp ranks of a group
# hold the same data, so data splits, sums and metrics go over this group.
_DATA_PARALLEL: tuple[Any, int, int] | None = None


@dataclass(frozen=True)
class RolloutLink:
    """``async_training.rollout_ranks``: the world's global ranks ``[0, trainers)`` train
    (their default group), the other ``generators`` generate (theirs); ``group`` (gloo,
    global ranks) joins both sides. One generating rank serves every training rank; several
    serve one training rank each (as many of them)."""

    group: Any
    generates: bool
    trainers: int
    generators: int = 1

    @property
    def peer(self) -> int:
        """The rank on the other side that this one takes from: a training rank's
        generating rank, a generating rank's training rank (the one that sends the orders
        where one generating rank serves them all)."""
        if self.generates:
            return self.group.rank() - self.trainers if self.generators > 1 else 0
        return self.trainers + (self.group.rank() if self.generators > 1 else 0)

    def served(self) -> list[int]:
        """The training ranks a generating rank sends to."""
        return [self.peer] if self.generators > 1 else list(range(self.trainers))

    def generating(self) -> list[int]:
        """Every generating rank (global ranks)."""
        return list(range(self.trainers, self.trainers + self.generators))


_LINK: RolloutLink | None = None


def rollout_link() -> RolloutLink | None:
    """The link to the other side, or None where every rank does both."""
    return _LINK


def init_distributed(timeout_s: float = 1800.0, rollout_ranks: int = 0) -> tuple[int, int]:
    """``(rank, world_size)`` of this rank's default group, creating it if there is none;
    ``timeout_s``: how long a collective waits for a rank that does not arrive
    (``trainer.collective_timeout_s``). With ``rollout_ranks`` (under torchrun) the last
    ranks get a default group of their own, the others theirs (:func:`rollout_link`)."""
    global _HOST_GROUP
    if not dist.is_initialized():
        if "RANK" in os.environ:  # torchrun
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if torch.cuda.is_available():
                local = int(os.environ.get("LOCAL_RANK", 0))
                # the sides of a split run each have a group of their own: they may share a GPU
                torch.cuda.set_device(local % torch.cuda.device_count() if rollout_ranks else local)
            timeout = timedelta(seconds=timeout_s)
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
            store = _attempt_store(store)
            if rollout_ranks:
                store, rank, world = _split(store, rank, world, rollout_ranks, timeout)
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world, timeout=timeout
            )
            if backend == "nccl" and dist.get_world_size() > 1:
                _HOST_GROUP = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        elif torch.cuda.is_available():
            # One process on a GPU machine trains on its GPU: a 1-rank NCCL group, so
            # default_device() is CUDA (a gloo group would silently train on the CPU).
            torch.cuda.set_device(0)
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def _split(store: dist.Store, rank: int, world: int, generators: int, timeout: timedelta):
    """``(store, rank, size)`` of this rank's side (training: the first ``world −
    generators`` ranks); the link between the sides (gloo: it carries host tensors, the
    weights in the engine's dtype and pickled batches)."""
    global _LINK
    trainers = world - generators
    link = dist.ProcessGroupGloo(dist.PrefixStore("klppo/link", store), rank, world, timeout)
    _LINK = RolloutLink(link, rank >= trainers, trainers, generators)
    side = "generate" if _LINK.generates else "train"
    mine = rank - trainers if _LINK.generates else rank
    return (
        dist.PrefixStore(f"klppo/{side}", store),
        mine,
        generators if _LINK.generates else trainers,
    )


def _attempt_store(store: dist.Store) -> dist.Store:
    """``store`` scoped to this torchrun attempt. torchrun's agent hosts one store for all of
    its ``--max-restarts`` attempts (torch 2.13; pytorch#135712): without a scope the
    restarted ranks can read the dead attempt's addresses and fail to connect. Under
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` rank 0 hosts a fresh store per attempt, so no
    scope (the restart count is per node, not agreed between nodes)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return store
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def failed_ranks(failed: bool) -> list[int]:
    """The ranks whose ``failed`` is true (every rank calls it: one host-side all-reduce of
    ``world_size`` flags; none at world size 1)."""
    if world_size() == 1:
        return [0] if failed else []
    flags = torch.zeros(world_size(), dtype=torch.int32)
    flags[dist.get_rank()] = int(failed)
    dist.all_reduce(flags, group=_HOST_GROUP)
    return flags.nonzero().flatten().tolist()


# A link receive that spans the other side's start-up (its models' build, the token-budget
# probe), which has no bound of its own: far past any collective's timeout, so only the
# message or the peer's closed connection (it died) ends it.
START_UP_WAIT = timedelta(days=365)

# What a call raises when its peer's process is gone or silent: gloo's transport (a closed
# or reset connection, a timeout); NCCL says "remote process exited or there was a network
# error". Not an out-of-memory or an engine's error.
PEER_FAILURE = re.compile(
    r"gloo/transport|Connection (reset|closed) by peer|remote process exited|Timed out waiting"
)


class LostRank(RuntimeError):
    """A collective waited ``trainer.collective_timeout_s`` for a rank that never came."""


def timed_out(err: BaseException, timeout_s: float) -> LostRank | None:
    """``err`` as a :class:`LostRank` naming the ranks that did not check in (every live
    rank calls it after the same timeout), or None when ``err`` is not a collective's
    timeout."""
    text = str(err)
    if not isinstance(err, RuntimeError) or "timed out" not in text.lower():
        return None
    silent = silent_ranks(min(timeout_s, 30.0))
    who = f"rank {', '.join(map(str, silent))} did not answer" if silent else text.splitlines()[0]
    return LostRank(
        f"rank {dist.get_rank()}: a collective waited trainer.collective_timeout_s="
        f"{timeout_s:g} s for another rank: {who}"
    )


def silent_ranks(wait_s: float) -> list[int]:
    """The ranks that do not check in within ``wait_s`` through the rendezvous store (the
    collectives' own connections are closed once one of them timed out)."""
    store = dist.distributed_c10d._get_default_store()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"klppo/alive/{attempt}/{{}}".format
    store.set(key(dist.get_rank()), "1")
    deadline = time.monotonic() + wait_s
    while True:
        missing = [r for r in range(world_size()) if not store.check([key(r)])]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.2)


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def from_main(value: T) -> T:
    """Rank 0's ``value`` on every rank (a collective; the value itself alone)."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def set_data_parallel(group: Any, rank: int = 0, size: int = 1) -> None:
    """Data splits, sums and metrics go over ``group`` (this rank is its ``rank``-th of
    ``size``) rather than the world (``None``: the world again): see
    :mod:`klppo_train.runtime.sequence_parallel`."""
    global _DATA_PARALLEL
    _DATA_PARALLEL = None if group is None else (group, rank, size)


def dp_size() -> int:
    """How many ranks hold different data (the world size without sequence parallelism)."""
    return _DATA_PARALLEL[2] if _DATA_PARALLEL else world_size()


def dp_rank() -> int:
    if _DATA_PARALLEL:
        return _DATA_PARALLEL[1]
    return dist.get_rank() if dist.is_initialized() else 0


def dp_group() -> Any:
    """The data-parallel process group (None: the world)."""
    return _DATA_PARALLEL[0] if _DATA_PARALLEL else None


def rank_span(count: int) -> range:
    """The indices of this rank's contiguous share of ``count`` items (the data-parallel
    ranks' shares differ by at most one)."""
    rank, size = dp_rank(), dp_size()
    return range((count * rank) // size, (count * (rank + 1)) // size)


def rank_slice(items: Sequence[T]) -> list[T]:
    """This rank's contiguous share of ``items`` (see :func:`rank_span`)."""
    span = rank_span(len(items))
    return list(items[span.start : span.stop])


def sum_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """``value`` summed over the data-parallel ranks (an all-reduced copy; ``value`` itself
    alone)."""
    if dp_size() == 1:
        return value
    value = value.clone()
    dist.all_reduce(value, group=dp_group())
    return value


# How a step's metric combines over ranks (the rest are token means, weighted by each
# rank's TOKENS): counts add up; these are equal-weight means -- per-sample means (ranks
# hold equal numbers of samples), values every rank shares (the updates' metrics: the
# trainees reduce them over the ranks), per-device throughput.
TOKENS = "perf/response_tokens"
# Each rank's loss tokens, the weight of the token means (they are means over the loss mask);
# a weight only, never logged.
LOSS_TOKENS = "_loss_tokens"
# klppo_train.runtime.engine.RolloutStats's counters (vLLM's, per step)
ROLLOUT_COUNTS = (
    "prompt_tokens",
    "generation_tokens",
    "preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
)
SUMS = (TOKENS, "reward/errors", *(f"rollout/{k}" for k in ROLLOUT_COUNTS))
MEANS = (
    "critic/score/mean",
    "response_length/mean",
    "actor/pg_loss",
    "critic/vf_loss",
    "actor/grad_norm",
    "critic/grad_norm",
    "actor/policy_version_sampled",
    "actor/on_policy_shortcut",
    "actor/reward_kl_penalty",  # per-sample (verl's batch KL: the mean of sequence means)
    "actor/reward_kl_penalty_coeff",
    "critic/vf_explained_var",  # computed over all ranks already
    "perf/throughput",
    "perf/actor_update_tflops",
    "perf/dp_imbalance_before",
    "perf/dp_imbalance_after",
    "rollout/prefix_cache_hit_rate",  # each rank's engine and cache
)
# Per-sample means of each rank's equal share of the step's samples (before the re-split).
MEAN_PREFIXES = ("multi_turn/", "tool/")
# Ratios whose denominator is another metric: weighted by it.
WEIGHTED_BY = {"tool/error_rate": "tool/calls_per_sample"}  # failed calls / calls


def _combine(name: str, values: list[float], tokens: list[float]) -> float:
    if name.startswith(("timing_s/", "perf/max_")) or name.endswith(("/max", "_max")):
        return max(values)  # the slowest rank; the largest value anywhere
    if name.endswith(("/min", "_min")):
        return min(values)
    if name in SUMS:
        return sum(values)
    if name in MEANS or name.startswith(("val/", *MEAN_PREFIXES)) or len(values) != len(tokens):
        return sum(values) / len(values)
    return sum(v * w for v, w in zip(values, tokens, strict=True)) / max(sum(tokens), 1.0)


def global_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """A step's metrics over all ranks, as one process on the whole batch would log them:
    maxima by max, counts summed, token means weighted by each rank's loss tokens
    (so ``metrics.jsonl`` does not change with the world size). The updates' metrics arrive
    global already (:func:`klppo_train.workers.trainee.mean_over_steps`)."""
    gathered = _gathered(metrics)
    if len(gathered) == 1:
        return {k: v for k, v in metrics.items() if k != LOSS_TOKENS}
    tokens = [m.get(LOSS_TOKENS, m.get(TOKENS, 1.0)) for m in gathered]
    combined = {
        key: _combine(key, [m[key] for m in gathered if key in m], tokens)
        for key in sorted({k for m in gathered for k in m} - {LOSS_TOKENS})
    }
    for name, by in WEIGHTED_BY.items():
        pairs = [(m[name], m[by]) for m in gathered if name in m and by in m]
        if pairs and sum(w for _, w in pairs) > 0:
            combined[name] = sum(v * w for v, w in pairs) / sum(w for _, w in pairs)
    return combined


def concat_over_ranks(counts: dict[str, list[float]]) -> dict[str, list[float]]:
    """Concatenate per-key lists from every rank (e.g. validation hits per data source)."""
    gathered = _gathered(counts)
    merged: dict[str, list[float]] = {}
    for part in gathered:
        for key, values in part.items():
            merged.setdefault(key, []).extend(values)
    return merged


def _gathered(value: T) -> list[T]:
    """Every data-parallel rank's ``value``, in rank order."""
    if dp_size() == 1:
        return [value]
    gathered: list[Any] = [None] * dp_size()
    dist.all_gather_object(gathered, value, group=dp_group())
    return gathered
