"""From an engine's samples to the trainer's tensors (verl's layout).

Prompts are left-padded to the longest prompt P, responses right-padded to the configured
``response_length`` T (a fixed width keeps shapes stable from step to step):
``input_ids = [prompt | response]`` ``[N, P + T]`` with one attention mask; N = prompts × n.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollout import RolloutBatch


@dataclass(frozen=True)
class RolloutTensors:
    """Attributes:
    input_ids, attention_mask: ``[N, P + T]``.
    response_mask: ``[N, T]`` 1 on generated tokens.
    engine_logprobs: ``[N, T]`` the engine's log-probs of the sampled tokens (0 at padding).
    prompt_index: ``[N]`` which prompt each sample answers (the GRPO/RLOO group).
    policy_version: the weights version that generated the samples.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    engine_logprobs: torch.Tensor
    prompt_index: torch.Tensor
    policy_version: int

    @property
    def response_ids(self) -> torch.Tensor:
        return self.input_ids[:, -self.response_mask.shape[1] :]


def rollout_tensors(
    prompts: Sequence[Sequence[int]],
    batch: RolloutBatch,
    *,
    pad_token_id: int,
    response_length: int,
    device: torch.device | str = "cpu",
) -> RolloutTensors:
    """Stack prompts and the engine's responses into :class:`RolloutTensors` on ``device``
    (the trainer's: the models' inputs, and every tensor computed from them, live there)."""
    index = [s.prompt_index for s in batch.samples]
    width = max(len(prompts[i]) for i in index)
    prompt_ids = torch.full((len(index), width), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(len(index), width, dtype=torch.long)
    for row, i in enumerate(index):
        length = len(prompts[i])
        prompt_ids[row, width - length :] = torch.tensor(list(prompts[i]), dtype=torch.long)
        prompt_mask[row, width - length :] = 1
    response_ids, logprobs, response_mask = batch.response_tensors(pad_token_id, response_length)
    return RolloutTensors(
        input_ids=torch.cat([prompt_ids, response_ids], dim=1).to(device),
        attention_mask=torch.cat([prompt_mask, response_mask], dim=1).to(device),
        response_mask=response_mask.to(device),
        engine_logprobs=logprobs.to(device),
        prompt_index=torch.tensor(index, dtype=torch.long, device=device),
        policy_version=batch.policy_version,
    )
