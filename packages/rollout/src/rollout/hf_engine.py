"""HF transformers engine: ``model.generate`` with a KV cache on the module it is given.

Useful for tests, for CPU machines without vLLM, and as a fallback. It shares the module
with nobody: ``update_weights`` copies the trainer's tensors into it.

Sampling is done by the engine, not by transformers: ``generate`` runs greedy with
:class:`_RowSampler` as its last logits processor, which warps the logits (temperature,
top-k, top-p: transformers' own warpers, in its order) and picks each row's token by
Gumbel-max with noise from that row's own seeded generator. A row's tokens therefore depend
only on its prompt, its seed and the sampling settings, not on the batch it is generated in.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

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
        """See :meth:`RolloutEngine.generate`.

        Each row (prompt ``i``, sample ``j`` of ``sampling.n``) samples from its own
        generator, seeded from ``(seeds[i], j)``, so a prompt's samples depend only on the
        model, the prompt, its seed and the sampling settings: not on the other prompts, their
        order or the chunking by ``max_tokens_per_batch`` (as vLLM's per-request seeds). The
        log-probs are of the distribution sampled from (after temperature / top-k / top-p).
        Without ``seeds`` row ``(i, j)`` is seeded from ``(sampling.seed, i, j)``; with
        neither, from a base seed drawn from torch's global generator (reproducible under
        ``torch.manual_seed``, which the engine itself never calls). Greedy
        (``temperature=0``) uses no generator. The model's own ``generation_config``
        (repetition penalty, top-k, ...) is not applied. Per-prompt ``max_new_tokens``
        generate to the largest and cut each row at its own (the tokens before a cut do not
        depend on it)."""
        vocab = self.model.get_input_embeddings().num_embeddings
        check_prompts(prompt_token_ids, vocab, self.config.max_model_len)
        check_seeds(seeds, len(prompt_token_ids))
        check_max_new_tokens(max_new_tokens, len(prompt_token_ids))
        if max_new_tokens is not None:
            sampling = replace(sampling, max_new_tokens=max(max_new_tokens))
        caps = max_new_tokens or [sampling.max_new_tokens] * len(prompt_token_ids)
        row_seeds = _row_seeds(sampling, seeds, len(prompt_token_ids))
        rows = [
            (i, list(p), row_seeds[i * sampling.n + j])
            for i, p in enumerate(prompt_token_ids)
            for j in range(sampling.n)
        ]
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
        # transformers reads eos_token_id=None as "not set" (to be filled from the model's
        # config), so ignoring EOS names an id that is never sampled: one past the vocabulary.
        vocab = self.model.get_input_embeddings().num_embeddings
        stops = (
            [vocab]
            if sampling.ignore_eos
            else [*self.config.eos_token_ids, *sampling.stop_token_ids]
        )
        # Greedy over the scores _RowSampler returns (a single finite entry per row): the
        # token choice is the sampler's.
        return GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=stops,
            pad_token_id=self.config.pad_token_id,
            do_sample=False,
            num_beams=1,
        )

    @torch.no_grad()
    def _generate_rows(self, rows, sampling: SamplingConfig) -> list[Sample]:
        device = next(self.model.parameters()).device
        ids, mask = left_pad([p for _, p, _ in rows], self.config.pad_token_id)
        generators = (
            None
            if sampling.greedy
            else [torch.Generator(device).manual_seed(seed) for _, _, seed in rows]
        )
        sampler = _RowSampler(sampling, generators)
        with _without_model_defaults(self.model):
            sequences = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                generation_config=self._generation_config(sampling),
                logits_processor=LogitsProcessorList([sampler]),
            )
        new = sequences[:, ids.shape[1] :].cpu()
        # transformers may run steps past the end (deferred stop checks) and drop them
        logprobs = torch.stack(sampler.logprobs, dim=1)[:, : new.shape[1]].cpu()
        stops = (
            set() if sampling.ignore_eos else {*self.config.eos_token_ids, *sampling.stop_token_ids}
        )
        return [
            self._sample(index, new[r].tolist(), logprobs[r].tolist(), stops)
            for r, (index, _, _) in enumerate(rows)
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


class _RowSampler(LogitsProcessor):
    """The last logits processor of a greedy ``generate``: samples each row's token itself.

    Warps the step's logits with transformers' warpers in its order (temperature, top-k,
    top-p), records the chosen token's log-prob under the warped distribution (the
    distribution sampled from, what vLLM's "processed_logprobs" reports), and picks the
    token by Gumbel-max: ``argmax(log_softmax(warped) + g)``, ``g = -log(-log(u))`` with
    ``u`` uniform from the row's own generator (``V`` draws per row per step), which is a
    sample of ``softmax(warped)``. Without generators (greedy) the token is the argmax of the
    logits. Returns scores that are 0 at the chosen token and -inf elsewhere, so the greedy
    ``generate`` takes exactly that token (or pads a finished row).
    """

    def __init__(self, sampling: SamplingConfig, generators: list[torch.Generator] | None):
        warpers: list[LogitsProcessor] = []
        if generators is not None:
            if sampling.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(float(sampling.temperature)))
            if sampling.top_k > 0:
                warpers.append(TopKLogitsWarper(top_k=sampling.top_k))
            if sampling.top_p < 1.0:
                warpers.append(TopPLogitsWarper(top_p=float(sampling.top_p)))
        self.warpers = LogitsProcessorList(warpers)
        self.generators = generators
        self.logprobs: list[torch.Tensor] = []  # per step: [rows]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        logprobs = torch.log_softmax(self.warpers(input_ids, scores.float()), dim=-1)
        if self.generators is None:
            tokens = logprobs.argmax(dim=-1)
        else:
            uniform = torch.empty_like(logprobs)
            for row, generator in zip(uniform, self.generators, strict=True):
                row.uniform_(generator=generator)
            # clamp: u = 0 would give an infinite draw (-inf + inf = nan on a filtered token)
            gumbel = -torch.log(-torch.log(uniform.clamp_(min=torch.finfo(uniform.dtype).tiny)))
            tokens = (logprobs + gumbel).argmax(dim=-1)
        self.logprobs.append(logprobs.gather(-1, tokens[:, None])[:, 0])
        chosen = torch.full_like(scores, -float("inf"))
        return chosen.scatter_(-1, tokens[:, None], 0.0)


def _row_seeds(
    sampling: SamplingConfig, seeds: Sequence[int] | None, num_prompts: int
) -> list[int | None]:
    """Each row's generator seed, prompt by prompt, ``sampling.n`` each (None when greedy).

    Row ``(i, j)``: a hash of ``(seeds[i], j)``, else of ``(sampling.seed, i, j)``, else of
    ``(base, i, j)`` with one base per call drawn from torch's global generator. A hash, not
    ``seed + j`` (vLLM's children): the app's per-prompt seeds are consecutive, and
    ``seed + j`` would give prompt ``i``'s sample ``j`` the stream of prompt ``i + 1``'s
    sample ``j - 1``."""
    n = sampling.n
    if sampling.greedy:
        return [None] * (num_prompts * n)
    if seeds is not None:
        keys = [(seeds[i], j) for i in range(num_prompts) for j in range(n)]
    else:
        base = sampling.seed
        if base is None:
            base = int(torch.randint(2**62, ()))
        keys = [(base, i, j) for i in range(num_prompts) for j in range(n)]
    return [_hash_seed(key) for key in keys]


def _hash_seed(key: tuple[int, ...]) -> int:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # < 2**63


@contextmanager
def _without_model_defaults(model: nn.Module) -> Iterator[None]:
    """``generate`` fills every setting its ``generation_config`` leaves unset from the
    model's own (a checkpoint's repetition penalty, suppressed tokens, ...), which would
    change the distribution the engine samples from; a blank one is in its place for the
    call."""
    own = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = own


def _cut(sample: Sample, cap: int) -> Sample:
    """``sample`` cut to its prompt's own cap (finish ``length`` if that cut it)."""
    if len(sample.response_token_ids) <= cap:
        return sample
    tokens, logprobs = sample.response_token_ids[:cap], sample.logprobs[:cap]
    return replace(sample, response_token_ids=tokens, logprobs=logprobs, finish_reason="length")
