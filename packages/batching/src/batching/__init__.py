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

from importlib.metadata import PackageNotFoundError, version

from batching.attention import (
    AttentionGroup,
    GroupAttention,
    VarlenLayout,
    group_by_length,
    matmul_causal_attention,
    sdpa_causal_attention,
    sequence_layout,
    varlen_causal_attention,
    varlen_layout,
)
from batching.budget_search import ProbePoint, search_budget
from batching.budgets import BudgetFinding, TokenBudgets, check_token_budgets, suggest_token_budgets
from batching.compiled_attention import MATMUL_MAX_LEN, compiled_group_attention
from batching.distributed import sync_num_micro_batches
from batching.micro_batches import (
    COMPUTE_LINEAR_COEFF,
    MicroBatchPlan,
    first_fit_decreasing_count,
    fixed_size_micro_batches,
    plan_from_parts,
    restore_order,
    sequence_workloads,
    token_budget_micro_batches,
)
from batching.packing import (
    Packing,
    block_causal_mask,
    cu_seqlens_from_positions,
    next_token_labels,
    pack,
    pack_values,
    unpack,
)
from batching.partition import balanced_partitions
from batching.per_token import PackedFn, micro_batch_plan, per_response_token, run_micro_batch
from batching.prompt_sharing import (
    PromptPrefixes,
    pack_shared_prompts,
    prompt_prefixes,
    shared_prompt_plan,
)
from batching.ranks import RankAssignment, balance_across_ranks

try:
    __version__ = version("klppo-batching")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "COMPUTE_LINEAR_COEFF",
    "MATMUL_MAX_LEN",
    "AttentionGroup",
    "GroupAttention",
    "VarlenLayout",
    "BudgetFinding",
    "MicroBatchPlan",
    "PackedFn",
    "Packing",
    "ProbePoint",
    "PromptPrefixes",
    "RankAssignment",
    "TokenBudgets",
    "balance_across_ranks",
    "balanced_partitions",
    "block_causal_mask",
    "check_token_budgets",
    "compiled_group_attention",
    "cu_seqlens_from_positions",
    "first_fit_decreasing_count",
    "fixed_size_micro_batches",
    "group_by_length",
    "micro_batch_plan",
    "next_token_labels",
    "pack",
    "pack_shared_prompts",
    "pack_values",
    "per_response_token",
    "plan_from_parts",
    "matmul_causal_attention",
    "prompt_prefixes",
    "restore_order",
    "run_micro_batch",
    "search_budget",
    "sdpa_causal_attention",
    "sequence_layout",
    "sequence_workloads",
    "shared_prompt_plan",
    "suggest_token_budgets",
    "sync_num_micro_batches",
    "token_budget_micro_batches",
    "unpack",
    "varlen_causal_attention",
    "varlen_layout",
]
