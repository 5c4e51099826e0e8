"""What an engine returns: samples stamped with the policy version, and tensor helpers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Turn:
    """One turn of a multi-turn response: its ``role`` (``assistant``: generated, trained
    on; ``tool`` or ``user``: appended, masked out of the loss), its tokens
    ``response_token_ids[start:end]``, the policy version that generated it (assistant
    turns; an appended turn keeps the version of the turn it answers), and for an appended
    turn the tool calls it answers, the kinds of failure among them
    (:data:`rollout.tools.TOOL_ERRORS`) and the reward the tools or environment gave."""

    role: str
    start: int
    end: int
    policy_version: int
    calls: int = 0
    errors: tuple[str, ...] = ()
    reward: float = 0.0


@dataclass(frozen=True)
class Sample:
    """One generated response.

    Attributes:
        prompt_index: index of its prompt in the ``generate`` call.
        response_token_ids: generated tokens, the stop token included when it ended on one.
        logprobs: log-probability of each generated token under the distribution it was
            sampled from (temperature, top-k and top-p applied; greedy: the model's own),
            same length as the tokens.
        finish_reason: ``"stop"`` (EOS or a stop token; multi-turn: an answer without a
            tool call), ``"length"`` (the response budget is spent) or ``"max_turns"``
            (multi-turn: the turn limit came while the model still called a tool).
        policy_version: version of the weights that generated it.
        loss_mask: 1 for each response token a trainer learns from, 0 for one it must not
            (a tool's output or an environment's observation inside a multi-turn
            response), same length as the tokens; None: every token (all were generated).
        turns: a multi-turn response's turns, in order, covering every token; empty for a
            single-turn response.
    """

    prompt_index: int
    response_token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    policy_version: int
    loss_mask: tuple[int, ...] | None = None
    turns: tuple[Turn, ...] = ()

    def __post_init__(self) -> None:
        if self.loss_mask is not None and len(self.loss_mask) != len(self.response_token_ids):
            raise ValueError(
                f"Sample.loss_mask has {len(self.loss_mask)} entries for "
                f"{len(self.response_token_ids)} response tokens"
            )


@dataclass(frozen=True)
class RolloutBatch:
    """Samples of one ``generate`` call: prompt 0's n samples, then prompt 1's, ..."""

    samples: list[Sample]
    policy_version: int

    def __len__(self) -> int:
        return len(self.samples)

    def response_tensors(
        self, pad_token_id: int, width: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded ``[B, T]`` responses, their log-probs (0 at padding) and the mask.

        Args:
            pad_token_id: filler for the token tensor.
            width: T; default the longest response.

        Returns:
            ``(token_ids long, logprobs float32, response_mask long)``.
        """
        width = (
            width
            if width is not None
            else max((len(s.response_token_ids) for s in self.samples), default=0)
        )
        ids = torch.full((len(self), width), pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(len(self), width, dtype=torch.float32)
        mask = torch.zeros(len(self), width, dtype=torch.long)
        for row, sample in enumerate(self.samples):
            length = len(sample.response_token_ids)
            if length > width:
                raise ValueError(f"sample {row} has {length} tokens, more than width={width}")
            ids[row, :length] = torch.tensor(sample.response_token_ids, dtype=torch.long)
            logprobs[row, :length] = torch.tensor(sample.logprobs, dtype=torch.float32)
            mask[row, :length] = 1
        return ids, logprobs, mask

    def loss_masks(self, width: int) -> torch.Tensor:
        """``[B, width]`` long: each sample's :attr:`Sample.loss_mask` (1 on every token
        where it is None), 0 at padding."""
        mask = torch.zeros(len(self), width, dtype=torch.long)
        for row, sample in enumerate(self.samples):
            length = len(sample.response_token_ids)
            if length > width:
                raise ValueError(f"sample {row} has {length} tokens, more than width={width}")
            given = sample.loss_mask
            mask[row, :length] = torch.tensor(given, dtype=torch.long) if given else 1
        return mask


def left_pad(
    prompts: Sequence[Sequence[int]], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``[B, P]`` prompt ids and attention mask (generation appends on the right)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
    return ids, mask


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_len: int | None) -> None:
    """Refuse bad prompts before any generation starts, naming the offending prompt."""
    if not prompts:
        raise ValueError("generate() got an empty prompt list")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        if max_len is not None and len(prompt) >= max_len:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens; max_model_len={max_len} leaves no room "
                "to generate"
            )
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
            )


def check_seeds(seeds: Sequence[int] | None, num_prompts: int) -> None:
    """Per-prompt seeds, if given, are one non-negative int per prompt."""
    if seeds is None:
        return
    if len(seeds) != num_prompts:
        raise ValueError(f"generate() got {len(seeds)} seeds for {num_prompts} prompts")
    if any(s < 0 for s in seeds):
        raise ValueError(f"seeds must be >= 0, got {min(seeds)}")


def check_max_new_tokens(caps: Sequence[int] | None, num_prompts: int) -> None:
    """Per-prompt caps, if given, are one int >= 1 per prompt."""
    if caps is None:
        return
    if len(caps) != num_prompts:
        raise ValueError(f"generate() got {len(caps)} max_new_tokens for {num_prompts} prompts")
    if any(c < 1 for c in caps):
        raise ValueError(f"max_new_tokens must be >= 1, got {min(caps)}")
