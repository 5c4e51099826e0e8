"""Batches in the trainer's layout, shared by the forward / actor / critic tests."""

import torch


def prompt_response_batch(
    prompt_lens,
    response_lens,
    P: int,
    T: int,
    vocab: int,
    seed: int = 0,
    generator: torch.Generator | None = None,
):
    """``[B, P + T]`` ids and attention mask: prompts left-padded to P, responses right-padded
    to T, random tokens (ids ≥ 3, clear of the special tokens)."""
    gen = generator or torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(prompt_lens), P + T, dtype=torch.long)
    mask = torch.zeros(len(prompt_lens), P + T, dtype=torch.long)
    for row, (p, r) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        ids[row, P - p : P + r] = torch.randint(3, vocab, (p + r,), generator=gen)
        mask[row, P - p : P + r] = 1
    return ids, mask
