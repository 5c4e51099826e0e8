"""klppo-batching: token-budget micro-batches, DP balancing and sequence packing.

- :func:`balanced_partitions`: Karmarkar–Karp k-way partitioning (optionally equal sizes)
- :func:`token_budget_micro_batches` → :class:`MicroBatchPlan`: hard-capped dynamic batch
  size; :func:`fixed_size_micro_batches`: verl's static mode (``use_dynamic_bsz=False``);
  :func:`restore_order` puts per-micro-batch outputs back in input order
- :func:`sync_num_micro_batches`: one micro-batch count across data-parallel ranks
- :func:`balance_across_ranks` → :class:`RankAssignment`: equal sequence counts per rank
  with balanced tokens
- :func:`pack` → :class:`Packing`, :func:`unpack`: sequence packing (remove padding);
  :func:`cu_seqlens_from_positions` finds a packed row's sequences from its positions
- :func:`varlen_causal_attention` over a :func:`varlen_layout`: packed causal attention at
  a cost linear in the sequences' own lengths (no ``[nnz, nnz]`` mask); each group through
  :func:`sdpa_causal_attention` or a given :data:`GroupAttention` such as
  :func:`compiled_group_attention` (short bf16 groups on CPU: compiled
  :func:`matmul_causal_attention`)
- :func:`pack_shared_prompts`: the ``n`` samples of a prompt run its tokens once
  (:func:`prompt_prefixes`, :func:`shared_prompt_plan` keeps a prompt in one micro-batch)
- :func:`per_response_token`: a model's per-token outputs over a verl prompt + response
  batch, micro-batched and packed, back in input order; :func:`run_micro_batch`: the same
  for one micro-batch already planned (an update's)
- :func:`check_token_budgets`, :func:`suggest_token_budgets`: budget rules of thumb
- :func:`search_budget`: choose a budget by measuring your own pass at L, 4L, 16L, ...
  (memory within an allowance, on CPU up to where tokens/s stops rising) → :class:`ProbePoint`
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("klppo-batching")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

# name → the submodule that defines it, imported on first use (PEP 562): a caller that
# needs one torch-free name (a config check) does not pay for torch.
_EXPORTS = {
    "COMPUTE_LINEAR_COEFF": "micro_batches",
    "MATMUL_MAX_LEN": "compiled_attention",
    "AttentionGroup": "attention",
    "GroupAttention": "attention",
    "VarlenLayout": "attention",
    "BudgetFinding": "budgets",
    "MicroBatchPlan": "micro_batches",
    "PackedFn": "per_token",
    "Packing": "packing",
    "ProbePoint": "budget_search",
    "PromptPrefixes": "prompt_sharing",
    "RankAssignment": "ranks",
    "TokenBudgets": "budgets",
    "balance_across_ranks": "ranks",
    "balanced_partitions": "partition",
    "block_causal_mask": "packing",
    "check_token_budgets": "budgets",
    "compiled_group_attention": "compiled_attention",
    "cu_seqlens_from_positions": "packing",
    "first_fit_decreasing_count": "micro_batches",
    "fixed_size_micro_batches": "micro_batches",
    "group_by_length": "attention",
    "micro_batch_plan": "per_token",
    "next_token_labels": "packing",
    "pack": "packing",
    "pack_shared_prompts": "prompt_sharing",
    "pack_values": "packing",
    "per_response_token": "per_token",
    "plan_from_parts": "micro_batches",
    "matmul_causal_attention": "attention",
    "prompt_prefixes": "prompt_sharing",
    "restore_order": "micro_batches",
    "run_micro_batch": "per_token",
    "search_budget": "budget_search",
    "sdpa_causal_attention": "attention",
    "sequence_layout": "attention",
    "sequence_workloads": "micro_batches",
    "shared_prompt_plan": "prompt_sharing",
    "suggest_token_budgets": "budgets",
    "sync_num_micro_batches": "distributed",
    "token_budget_micro_batches": "micro_batches",
    "unpack": "packing",
    "varlen_causal_attention": "attention",
    "varlen_layout": "attention",
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
