"""PPO with klppo-ppo-core and klppo-batching inside a plain PyTorch + transformers loop.

Not klppo's trainer: what the two packages are for, in a loop you own. A tiny Qwen2 built
from a config samples responses with Hugging Face ``generate``; a rule rewards the share of
response tokens that are token ``TARGET``; GRPO advantages (each prompt's samples are each
other's baseline); the clipped policy loss plus a KL loss to a frozen reference; each
mini-batch cut into micro-batches within a token budget (``batching``), every micro-batch's
loss its exact share of the mini-batch's token mean, so the accumulated gradient is the
whole mini-batch's.

    python examples/ppo_core_plain_torch.py --steps 30

prints the mean reward per step; it rises from ~1/32 as the policy learns to emit TARGET.
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from batching import token_budget_micro_batches
from ppo_core import (
    aggregate_loss,
    compute_grpo_advantages,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    policy_loss,
)

VOCAB, PROMPT, RESPONSE, TARGET = 32, 4, 8, 7


def tiny_model(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=1,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


def response_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """log π(response token | everything before it), ``[B, RESPONSE]`` (fp32)."""
    logits = model(ids).logits[:, PROMPT - 1 : -1]  # the positions that predict a response token
    return logprobs_from_logits(logits, ids[:, PROMPT:])


@torch.no_grad()
def rollout(policy, prompts: int, samples: int, generator: torch.Generator):
    """``(ids [B, P + T], group_ids [B], scores [B])`` for ``prompts × samples`` responses."""
    prompt_ids = torch.randint(2, VOCAB, (prompts, PROMPT), generator=generator)
    prompt_ids = prompt_ids.repeat_interleave(samples, dim=0)
    ids = policy.generate(
        prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=True,
        max_new_tokens=RESPONSE, min_new_tokens=RESPONSE, pad_token_id=0,
    )  # fmt: skip
    scores = (ids[:, PROMPT:] == TARGET).float().mean(-1)
    return ids, torch.arange(prompts).repeat_interleave(samples), scores


def update(policy, ref, optimizer, ids, advantages, old_logprobs, *, max_tokens: int) -> dict:
    """One optimizer step over micro-batches of at most ``max_tokens`` tokens."""
    mask = torch.ones(ids.shape[0], RESPONSE)
    with torch.no_grad():
        ref_logprobs = response_logprobs(ref, ids)
    counts = {"global_num_tokens": mask.sum()}  # each micro-batch's loss: its share
    plan = token_budget_micro_batches(torch.full((ids.shape[0],), ids.shape[1]), max_tokens)
    metrics: dict[str, float] = {}
    for rows in map(list, plan.micro_batches):
        logprobs = response_logprobs(policy, ids[rows])
        loss, pg = policy_loss(logprobs, old_logprobs[rows], advantages[rows], mask[rows], **counts)
        kl = kl_penalty(logprobs, ref_logprobs[rows], "low_var_kl")
        loss = loss + 0.01 * aggregate_loss(kl, mask[rows], "token-mean", **counts)
        loss.backward()
        metrics["kl"] = metrics.get("kl", 0.0) + float(masked_mean(kl.detach(), mask[rows]))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"kl": metrics["kl"] / len(plan.micro_batches), "micro_batches": len(plan)}


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)  # 8 sequences of 12 tokens
    args = parser.parse_args(argv)
    policy = tiny_model(seed=0)
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    rewards = []
    for step in range(args.steps):
        ids, groups, scores = rollout(policy, args.prompts, args.samples, generator)
        mask = torch.ones(ids.shape[0], RESPONSE)
        advantages, _ = compute_grpo_advantages(scores, groups, mask)
        with torch.no_grad():
            old_logprobs = response_logprobs(policy, ids)  # one update per batch: on-policy
        stats = update(policy, ref, optimizer, ids, advantages, old_logprobs,
                       max_tokens=args.max_tokens)  # fmt: skip
        rewards.append(float(scores.mean()))
        print(f"step {step}: reward {rewards[-1]:.3f}, kl {stats['kl']:.4f}, "
              f"{stats['micro_batches']} micro-batches")  # fmt: skip
    return rewards


if __name__ == "__main__":
    main()
