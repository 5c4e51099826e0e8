"""klppo-rollout: generation engines behind one Protocol, with weight sync.

- :class:`SamplingConfig`; :class:`RolloutEngine` (Protocol); :class:`RolloutBatch`, :class:`Sample`
- :class:`HFEngine` (+ :class:`HFEngineConfig`): transformers ``generate``
- :class:`VLLMEngine` (+ :class:`VLLMConfig`): vLLM, imported only when constructed
- :class:`WeightSync`, :func:`logprob_mismatch`; :func:`left_pad` (prompts as ``[B, P]`` tensors)
"""

from importlib.metadata import PackageNotFoundError, version

from rollout.config import SamplingConfig
from rollout.hf_engine import HFEngine, HFEngineConfig
from rollout.protocol import RolloutEngine
from rollout.sync import WeightSync, logprob_mismatch
from rollout.types import RolloutBatch, Sample, left_pad
from rollout.vllm_engine import VLLMConfig, VLLMEngine

try:
    __version__ = version("klppo-rollout")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "HFEngine",
    "HFEngineConfig",
    "RolloutBatch",
    "RolloutEngine",
    "Sample",
    "SamplingConfig",
    "VLLMConfig",
    "VLLMEngine",
    "WeightSync",
    "left_pad",
    "logprob_mismatch",
]
