"""Sampling settings shared by every engine."""

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
