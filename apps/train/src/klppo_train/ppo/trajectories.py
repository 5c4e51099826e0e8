"""The step's one container of samples: the engine's output in verl's layout, and what each
stage of the step adds to it (log-probs, values, advantages, returns).

Prompts are left-padded to the longest prompt P, responses right-padded to the configured
``response_length`` T (a fixed width keeps shapes stable from step to step):
``input_ids = [prompt | response]`` ``[N, P + T]`` with one attention mask; N = prompts × n.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from rollout import RolloutBatch, left_pad


@dataclass(frozen=True)
class Trajectories:
    """Attributes (every tensor on the trainer's device; None where no stage made it yet):
    input_ids, attention_mask: ``[N, P + T]``.
    response_mask: ``[N, T]`` 1 on generated tokens.
    engine_logprobs: ``[N, T]`` the engine's log-probs of the sampled tokens (0 at padding).
    prompt_index: ``[N]`` which prompt each sample answers (the GRPO/RLOO group), as an
        index into this rank's prompts.
    prompt_position: ``[N]`` that prompt's position in the step's batch over all ranks (the
        global mini-batches are cut by it); None: ``prompt_index`` (one process).
    policy_version: the weights version that generated the samples.
    old_logprobs, entropy: ``[N, T]`` the policy's before the update (the old-log-prob pass;
        None on the on-policy shortcut: logπ_old = sg(logπ) in the update).
    ref_logprobs: ``[N, T]`` the reference's (None without a reference).
    values: ``[N, T]`` the critic's before its update (None without a critic).
    advantages, returns: ``[N, T]`` the estimator's.
    is_weights: ``[N, T]`` rollout-correction weights π_old/π_rollout for the policy loss
        (None: no correction, or bypass mode, which computes them in the loss).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    engine_logprobs: torch.Tensor
    prompt_index: torch.Tensor
    policy_version: int = 0
    prompt_position: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None

    @property
    def response_ids(self) -> torch.Tensor:
        return self.input_ids[:, -self.response_mask.shape[1] :]

    def rows(self, index: torch.Tensor) -> Trajectories:
        """The samples ``index`` (a mini- or micro-batch): every tensor indexed alike."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: v[index] for k, v in values.items() if torch.is_tensor(v)})


def trajectories(
    prompts: Sequence[Sequence[int]],
    batch: RolloutBatch,
    *,
    pad_token_id: int,
    response_length: int,
    device: torch.device | str = "cpu",
    positions: Sequence[int] | None = None,
) -> Trajectories:
    """Stack prompts and the engine's responses into :class:`Trajectories` on ``device``
    (the trainer's: the models' inputs, and every tensor computed from them, live there).
    ``positions``: each prompt's position in the step's batch over all ranks."""
    index = [s.prompt_index for s in batch.samples]
    position = None
    if positions is not None:
        position = torch.tensor([positions[i] for i in index], dtype=torch.long, device=device)
    prompt_ids, prompt_mask = left_pad([prompts[i] for i in index], pad_token_id)
    response_ids, logprobs, response_mask = batch.response_tensors(pad_token_id, response_length)
    return Trajectories(
        input_ids=torch.cat([prompt_ids, response_ids], dim=1).to(device),
        attention_mask=torch.cat([prompt_mask, response_mask], dim=1).to(device),
        response_mask=response_mask.to(device),
        engine_logprobs=logprobs.to(device),
        prompt_index=torch.tensor(index, dtype=torch.long, device=device),
        policy_version=batch.policy_version,
        prompt_position=position,
    )
