"""HF transformers engine: ``model.generate`` with a KV cache on the module it is given.

Useful for tests, for CPU machines without vLLM, and as a fallback. It shares the module
with nobody: ``update_weights`` copies the trainer's tensors into it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig

from rollout.config import HFEngineConfig, SamplingConfig
from rollout.types import (
    RolloutBatch,
    Sample,
    check_max_new_tokens,
    check_prompts,
    check_seeds,
    left_pad,
)


class HFEngine:
    """A :class:`~rollout.protocol.RolloutEngine` over a local HF causal LM."""

    def __init__(self, model: nn.Module, config: HFEngineConfig) -> None:
        if config.pad_token_id is None or not config.eos_token_ids:
            raise ValueError(
                "HFEngineConfig needs pad_token_id and eos_token_ids (the tokenizer's)"
            )
        self.model = model.eval()
        self.config = config
        self.policy_version = 0
        self._generated_tokens = 0
        self._generate_seconds = 0.0

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        *,
        seeds: Sequence[int] | None = None,
        max_new_tokens: Sequence[int] | None = None,
    ) -> RolloutBatch:
        """See :meth:`RolloutEngine.generate`: batched ``generate`` draws every row from one
        generator, seeded with ``seeds[0]`` (or ``sampling.seed``); per-prompt
        ``max_new_tokens`` generate to the largest and cut each row at its own (the tokens
        before a cut do not depend on it)."""
        vocab = self.model.get_input_embeddings().num_embeddings
        check_prompts(prompt_token_ids, vocab, self.config.max_model_len)
        check_seeds(seeds, len(prompt_token_ids))
        check_max_new_tokens(max_new_tokens, len(prompt_token_ids))
        if max_new_tokens is not None:
            sampling = replace(sampling, max_new_tokens=max(max_new_tokens))
        seed = seeds[0] if seeds else sampling.seed
        if seed is not None:
            torch.manual_seed(seed)
        caps = max_new_tokens or [sampling.max_new_tokens] * len(prompt_token_ids)
        rows = [(i, list(p)) for i, p in enumerate(prompt_token_ids) for _ in range(sampling.n)]
        start = time.perf_counter()
        samples = [
            _cut(s, caps[s.prompt_index])
            for chunk in self._chunks(rows, sampling)
            for s in self._generate_rows(chunk, sampling)
        ]
        self._generate_seconds += time.perf_counter() - start
        self._generated_tokens += sum(len(s.response_token_ids) for s in samples)
        return RolloutBatch(samples, self.policy_version)

    def _chunks(self, rows, sampling: SamplingConfig) -> Iterator[list]:
        chunk: list = []
        for row in rows:
            width = max(len(r[1]) for r in [*chunk, row]) + sampling.max_new_tokens
            if chunk and width * (len(chunk) + 1) > self.config.max_tokens_per_batch:
                yield chunk
                chunk = []
            chunk.append(row)
        if chunk:
            yield chunk

    def _generation_config(self, sampling: SamplingConfig) -> GenerationConfig:
        # transformers reads eos_token_id=None as "not set" and falls back to the model's
        # EOS, so ignoring EOS needs an id that is never sampled: one past the vocabulary.
        vocab = self.model.get_input_embeddings().num_embeddings
        stops = (
            [vocab]
            if sampling.ignore_eos
            else [*self.config.eos_token_ids, *sampling.stop_token_ids]
        )
        kwargs = (
            {"do_sample": False}
            if sampling.greedy
            else {
                "do_sample": True,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k if sampling.top_k > 0 else 0,  # 0 = off (None = 50)
            }
        )
        return GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=stops,
            pad_token_id=self.config.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
            **kwargs,
        )

    @torch.no_grad()
    def _generate_rows(self, rows, sampling: SamplingConfig) -> list[Sample]:
        device = next(self.model.parameters()).device
        ids, mask = left_pad([p for _, p in rows], self.config.pad_token_id)
        out = self.model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            generation_config=self._generation_config(sampling),
        )
        new = out.sequences[:, ids.shape[1] :].cpu()
        # scores = logits after temperature / top-k / top-p, the distribution sampled from
        # (what vLLM's "processed_logprobs" mode reports too)
        scores = torch.stack(out.scores, dim=1).float().cpu()  # [rows, steps, V]
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new[..., None]).squeeze(-1)
        stops = (
            set() if sampling.ignore_eos else {*self.config.eos_token_ids, *sampling.stop_token_ids}
        )
        return [
            self._sample(index, new[r].tolist(), logprobs[r].tolist(), stops)
            for r, (index, _) in enumerate(rows)
        ]

    def _sample(
        self, index: int, tokens: list[int], logprobs: list[float], stops: set[int]
    ) -> Sample:
        end = next((t + 1 for t, tok in enumerate(tokens) if tok in stops), None)
        reason = "stop" if end is not None else "length"
        end = end if end is not None else len(tokens)
        return Sample(
            index, tuple(tokens[:end]), tuple(logprobs[:end]), reason, self.policy_version
        )

    @torch.no_grad()
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"update_weights: the model has no parameter {name!r}")
            params[name].copy_(tensor)
        self.policy_version = version

    def sleep(self) -> None:
        """No-op: the module is the trainer's to move (see fsdp_sharding.offload_model)."""

    def wake_up(self) -> None:
        """No-op, see :meth:`sleep`."""

    def stats(self) -> dict[str, Any]:
        seconds = self._generate_seconds
        return {
            "generated_tokens": self._generated_tokens,
            "generate_seconds": seconds,
            "tokens_per_s": self._generated_tokens / seconds if seconds else 0.0,
            "policy_version": self.policy_version,
        }

    def close(self) -> None:
        self.model = None


def _cut(sample: Sample, cap: int) -> Sample:
    """``sample`` cut to its prompt's own cap (finish ``length`` if that cut it)."""
    if len(sample.response_token_ids) <= cap:
        return sample
    tokens, logprobs = sample.response_token_ids[:cap], sample.logprobs[:cap]
    return replace(sample, response_token_ids=tokens, logprobs=logprobs, finish_reason="length")
