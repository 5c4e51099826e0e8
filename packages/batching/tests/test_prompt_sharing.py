"""Shared-prompt packing: a prompt's samples run its tokens once, and every sequence still
gets exactly what a plain packing (one copy of the prompt per sequence) gives it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from batching import (
    Packing,
    next_token_labels,
    pack,
    pack_shared_prompts,
    per_response_token,
    prompt_prefixes,
    shared_prompt_plan,
    varlen_causal_attention,
)

P, T = 5, 4


def verl_batch(groups: list[tuple[list[int], list[list[int]]]]):
    """``[B, P + T]`` rows from ``(prompt, [response, ...])`` groups: left-padded prompt,
    right-padded response."""
    ids = torch.zeros(sum(len(r) for _, r in groups), P + T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    row = 0
    for prompt, responses in groups:
        for response in responses:
            ids[row, P - len(prompt) : P] = torch.tensor(prompt)
            ids[row, P : P + len(response)] = torch.tensor(response, dtype=torch.long)
            mask[row, P - len(prompt) : P + len(response)] = 1
            row += 1
    return ids, mask


def test_prompt_prefixes_by_hand():
    ids, mask = verl_batch([([7, 8, 9], [[1], [2, 3]]), ([8, 9], [[4]]), ([7, 8, 9], [[5]])])
    prefixes = prompt_prefixes(ids, mask, P)
    assert prefixes.group == (0, 0, 2, 0)  # row 3 has row 0's prompt; [8, 9] differs
    assert prefixes.prefix == (2, 2, 1, 2)  # all prompt tokens but the last


def test_pack_by_hand():
    ids, mask = verl_batch([([7, 8, 9], [[1], [2, 3]]), ([6], [[4]])])
    p = pack_shared_prompts(ids, mask, P)
    # prefix 7 8 once, then each sequence's last prompt token and response
    assert p.input_ids.tolist() == [[7, 8, 9, 1, 9, 2, 3, 6, 4]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 2, 3, 4, 0, 1]]
    flat = P + T
    row1, row2 = [flat + c for c in (4, 5, 6)], [2 * flat + c for c in (4, 5)]
    assert p.indices.tolist() == [2, 3, 4, 5, *row1, *row2]
    # sequence 1 attends over the shared prefix (packed 0, 1), then its own tokens 4, 5, 6
    gathers = [g.gather.tolist() for g in p.layout.groups]
    assert [0, 1, 4, 5, 6] in gathers[0]
    labels, _ = next_token_labels(p)
    assert labels[0, [2, 4, 5]].tolist() == [1, 2, 3]  # each "9" predicts its own response


def toy_model(dim: int = 8, seed: int = 0):
    """Per-token embeddings (token and position), one causal attention layer, a per-token
    head: a model whose attention is the only thing that mixes tokens, in float64."""
    g = torch.Generator().manual_seed(seed)
    params = {
        "tok": torch.randn(32, dim, generator=g, dtype=torch.float64),
        "pos": torch.randn(P + T, dim, generator=g, dtype=torch.float64),
        "qkv": torch.randn(dim, 3 * 2 * 4, generator=g, dtype=torch.float64),
        "head": torch.randn(2 * 4, 3, generator=g, dtype=torch.float64),
    }
    for p in params.values():
        p.requires_grad_(True)

    def run(packing: Packing, keep: torch.Tensor) -> tuple[torch.Tensor]:
        x = params["tok"][packing.input_ids[0]] + params["pos"][packing.position_ids[0]]
        q, k, v = (x @ params["qkv"]).view(-1, 3, 2, 4).unbind(1)  # [nnz, 2 heads, 4]
        layout = packing.layout
        if layout is None:
            from batching import varlen_layout

            layout = varlen_layout(packing.cu_seqlens)
        out = varlen_causal_attention(q, k, v, layout).reshape(-1, 8)
        return ((out @ params["head"]).sum(-1)[keep],)

    return params, run


@settings(max_examples=25, deadline=None)
@given(
    groups=st.lists(
        st.tuples(
            st.lists(st.integers(1, 31), min_size=0, max_size=P),
            st.lists(st.lists(st.integers(1, 31), max_size=T), min_size=1, max_size=4),
        ),
        min_size=1,
        max_size=5,
    ),
    budget=st.sampled_from([9, 20, 1000]),
)
@example(groups=[([1, 1], [[], [], [], [1]]), ([6, 1, 1], [[10, 24, 1]])], budget=9)  # 1.3e-10
def test_outputs_and_gradients_equal_plain_packing(groups, budget):
    ids, mask = verl_batch(groups)
    perm = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(0))
    ids, mask = ids[perm], mask[perm]
    results = []
    for share in (False, True):
        params, run = toy_model()
        (out,) = per_response_token(
            None,
            ids,
            mask,
            T,
            lambda model, packing, keep, run=run: run(packing, keep),
            max_tokens=budget,
            sync_ranks=False,
            share_prompts=share,
        )
        valid = mask[:, P:].bool()  # positions that predict a response token
        out[valid].square().sum().backward()
        results.append((out[valid], [p.grad for p in params.values()]))
    (plain, plain_grads), (shared, shared_grads) = results
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-12)
    # Float64 sums in another order: gradients of ~1e4 (summed over every kept token) differ
    # in the last bits (seen: 1.3e-10 absolute, 6e-15 relative), so relative, not absolute.
    for got, want in zip(shared_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-10)


def test_fewer_tokens_run_when_prompts_repeat():
    prompt = [3, 4, 5, 6, 7]
    ids, mask = verl_batch([(prompt, [[1, 2], [1], [2, 2, 2], []])])
    assert pack(ids, mask).nnz == 4 * 5 + 6
    assert pack_shared_prompts(ids, mask, P).nnz == 4 + 4 * 1 + 6  # prefix once


def test_plan_keeps_a_prompt_together_and_counts_shared_tokens():
    groups = [([g, 2, 3, 4, 5], [[6, 7, 8, 9]] * 4) for g in range(3)]
    ids, mask = verl_batch(groups)
    prefixes = prompt_prefixes(ids, mask, P)
    lengths = mask.sum(-1)  # 9 tokens each, 36 per prompt; shared: 4 + 4 * 5 = 24
    plan = shared_prompt_plan(lengths, prefixes, max_tokens=48)
    prompts = [{i // 4 for i in members} for members in plan.micro_batches]
    assert sorted(len(p) for p in prompts) == [1, 2]  # two prompts fit in 48, never 3
    assert sorted(len(m) for m in plan.micro_batches) == [4, 8]  # whole prompts
    assert sorted(plan.token_sums) == [24, 48]
    for members, tokens in zip(plan.micro_batches, plan.token_sums, strict=True):
        rows = torch.tensor(members)
        assert pack_shared_prompts(ids[rows], mask[rows], P).nnz == tokens <= 48
    # a prompt whose samples exceed the budget together is split, each part with its prefix
    split = shared_prompt_plan(lengths, prefixes, max_tokens=20)
    assert max(split.token_sums) <= 20
    assert all(len(m) <= 3 for m in split.micro_batches)
    # a forced count above the number of prompts splits prompts
    forced = shared_prompt_plan(lengths, prefixes, max_tokens=48, num_micro_batches=5)
    assert len(forced) == 5
    assert sorted(i for m in forced.micro_batches for i in m) == list(range(12))


def test_plan_names_a_sequence_over_the_budget():
    ids, mask = verl_batch([([1, 2, 3], [[4, 5, 6, 7]]), ([1], [[2]])])
    with pytest.raises(ValueError, match="sequence 0 has 7 tokens"):
        shared_prompt_plan(mask.sum(-1), prompt_prefixes(ids, mask, P), max_tokens=6)
