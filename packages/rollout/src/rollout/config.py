"""The engines' settings: sampling (shared by every engine), the HF engine's, vLLM's.

Plain dataclasses without torch, so a configuration can be checked before torch loads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How to sample responses (the same meaning in the vLLM and HF engines).

    Attributes:
        n: samples per prompt (GRPO/RLOO groups); samples of one prompt are contiguous.
        temperature: 0 = greedy; the returned log-probs are of the tempered distribution.
        top_p: nucleus mass in (0, 1]; 1 = off.
        top_k: keep the k most likely tokens; -1 = off.
        max_new_tokens: response length cap (finish reason "length" when hit).
        seed: per-request seed for reproducible sampling; None = engine's RNG.
        stop_token_ids: extra token ids that end a response (besides EOS).
        ignore_eos: keep generating past EOS (benchmarks).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        checks = [
            ("n", self.n >= 1, "must be >= 1"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 1, "must be -1 (off) or >= 1"),
            ("max_new_tokens", self.max_new_tokens >= 1, "must be >= 1"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"SamplingConfig.{name} {rule}, got {getattr(self, name)!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"SamplingConfig.stop_token_ids must be >= 0, got {self.stop_token_ids}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, kw_only=True)
class HFEngineConfig:
    """Attributes:
    pad_token_id: filler for left-padded prompts and finished rows (the tokenizer's; the
        engine refuses to start without one).
    eos_token_ids: ids that end a response.
    max_tokens_per_batch: rows × (longest prompt + max_new_tokens) per ``generate`` call:
        the engine's memory lever (its KV cache grows with it).
    max_model_len: refuse prompts that leave no room below this length.
    """

    pad_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_tokens_per_batch: int = 16384
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens_per_batch < 1:
            raise ValueError(
                f"HFEngineConfig.max_tokens_per_batch must be >= 1, got {self.max_tokens_per_batch}"
            )


@dataclass(frozen=True, kw_only=True)
class VLLMConfig:
    """The vLLM knobs users know (vLLM's ``EngineArgs`` of the same names).

    Attributes:
        tensor_parallel_size: GPUs one engine spans.
        gpu_memory_utilization: GPU only: fraction of GPU memory vLLM may take (weights +
            KV cache), in (0, 1].
        max_num_batched_tokens: tokens per engine step (prefill chunk); ``None`` = vLLM's.
        max_num_seqs: sequences decoded together.
        max_model_len: prompt + response limit; ``None`` = the model's.
        dtype: weights/activations dtype; ``None`` = float32 on CPU (bf16 there is slower
            on CPUs without AVX512-BF16 and its log-probs drift ~1e-3 from an fp32 trainer),
            "auto" on GPU.
        enforce_eager: no CUDA graphs (faster start, slower decode).
        enable_prefix_caching: reuse KV blocks of shared prompt prefixes (GRPO groups).
        kv_cache_space_gib: CPU only: KV cache size (passed as ``kv_cache_memory_bytes``);
            vLLM's CPU default asks for 92 % of RAM and fails.
        disable_log_stats: skip vLLM's statistics (its Prometheus metrics: the counters
            :meth:`VLLMEngine.stats` reports).
        distributed_executor_backend: vLLM's ("mp", "ray", ...); ``None`` = its choice.
        sleep_level: GPU only: 1 offloads weights and drops the KV cache, 2 drops both.
        seed: the engine's base seed (requests with their own seed ignore it).
    """

    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None
    dtype: str | None = None
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    kv_cache_space_gib: float = 1.0
    disable_log_stats: bool = True
    distributed_executor_backend: str | None = None
    sleep_level: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            ("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "in (0, 1]"),
            ("sleep_level", self.sleep_level in (1, 2), "1 or 2"),
            ("tensor_parallel_size", self.tensor_parallel_size >= 1, ">= 1"),
            ("max_num_seqs", self.max_num_seqs >= 1, ">= 1"),
            ("kv_cache_space_gib", self.kv_cache_space_gib > 0, "> 0"),
            ("max_num_batched_tokens", _none_or_positive(self.max_num_batched_tokens), ">= 1"),
            ("max_model_len", _none_or_positive(self.max_model_len), ">= 1"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"VLLMConfig.{name} must be {rule}, got {getattr(self, name)!r}")


def _none_or_positive(value: int | None) -> bool:
    return value is None or value >= 1


TRUNCATE_SIDES = ("left", "right", "middle")


@dataclass(frozen=True, kw_only=True)
class MultiTurnConfig:
    """How a multi-turn rollout advances (verl's ``actor_rollout_ref.rollout.multi_turn.*``).

    Attributes:
        max_assistant_turns: generated turns per conversation; None = until the model
            answers without a call or the response budget is spent.
        max_user_turns: appended turns (tool answers and user turns: verl counts both);
            None = no limit.
        max_parallel_calls: tool calls answered per assistant turn (the first ones; verl's
            default 1).
        max_tool_response_length: a tool's answer is cut to this many characters.
        tool_response_truncate_side: ``left`` keeps the start, ``right`` the end,
            ``middle`` both ends.
        format: the tool-call format parsed from the model's text (``hermes``).
        tool_timeout_s: a tool call running longer is answered as timed out.
    """

    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    format: str = "hermes"
    tool_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        from rollout.tool_parsers import TOOL_CALL_FORMATS  # torch-free

        checks = [
            ("max_assistant_turns", _none_or_positive(self.max_assistant_turns), ">= 1 or null"),
            ("max_user_turns", _none_or_positive(self.max_user_turns), ">= 1 or null"),
            ("max_parallel_calls", self.max_parallel_calls >= 1, ">= 1"),
            ("max_tool_response_length", self.max_tool_response_length >= 1, ">= 1"),
            (
                "tool_response_truncate_side",
                self.tool_response_truncate_side in TRUNCATE_SIDES,
                f"one of {list(TRUNCATE_SIDES)}",
            ),
            ("format", self.format in TOOL_CALL_FORMATS, f"one of {sorted(TOOL_CALL_FORMATS)}"),
            ("tool_timeout_s", self.tool_timeout_s > 0, "> 0"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(
                    f"MultiTurnConfig.{name} must be {rule}, got {getattr(self, name)!r}"
                )
