"""klppo-rollout: generation engines behind one Protocol, with weight sync.

- :class:`SamplingConfig`; :class:`RolloutEngine` (Protocol); :class:`RolloutBatch`, :class:`Sample`
- :class:`HFEngine` (+ :class:`HFEngineConfig`): transformers ``generate``
- :class:`VLLMEngine` (+ :class:`VLLMConfig`): vLLM, imported only when constructed
- :class:`WeightPublisher` (Protocol) and its :class:`WeightSync`; :func:`logprob_mismatch`;
  :func:`left_pad` (prompts as ``[B, P]`` tensors)
- Multi-turn: :class:`MultiTurnRollout` (+ :class:`MultiTurnConfig`) over any engine,
  :class:`Turn`; :class:`Environment` (Protocol), :class:`ToolEnvironment`,
  :class:`Observation`; tools: :class:`Tool` (Protocol), :class:`ToolBox`,
  :class:`ToolCall`, :class:`ToolResult`, the built-in :class:`Calculator`; tool-call
  formats :data:`TOOL_CALL_FORMATS` (:class:`HermesParser`); :class:`TurnRenderer` (the
  appended turns' ids); :func:`multi_turn_metrics`
- LoRA: :class:`AdapterSync` (a :class:`WeightPublisher`: only the adapters sent, merged
  into the engine's base weights), :class:`BaseWeights`, :func:`merged_weights`,
  :func:`adapter_module`
- Between ranks (``async_training.rollout_ranks``): :class:`StreamedEngine` (the training
  side's stand-in for an engine on another rank), :func:`receive_weights`,
  :func:`send_object` / :func:`recv_object` / :func:`wait_all`, :class:`Outbox`
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("klppo-rollout")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

# name → the submodule that defines it, imported on first use (PEP 562): a caller that
# needs one torch-free name (a config check) does not pay for torch.
_EXPORTS = {
    "AdapterSync": "lora",
    "Calculator": "calculator",
    "Environment": "environments",
    "HermesParser": "tool_parsers",
    "MultiTurnConfig": "config",
    "MultiTurnRollout": "multi_turn",
    "Observation": "environments",
    "TOOL_CALL_FORMATS": "tool_parsers",
    "TOOL_ERRORS": "tools",
    "Tool": "tools",
    "ToolBox": "tools",
    "ToolCall": "tools",
    "ToolCallParser": "tool_parsers",
    "ToolEnvironment": "environments",
    "ToolResult": "tools",
    "Turn": "types",
    "TurnRenderer": "chat",
    "check_tool_schema": "tools",
    "multi_turn_metrics": "multi_turn",
    "BaseWeights": "lora",
    "adapter_module": "lora",
    "adapter_pairs": "lora",
    "merged_weights": "lora",
    "Outbox": "stream",
    "PeerWatch": "stream",
    "StreamedEngine": "stream",
    "receive_weights": "stream",
    "recv_object": "stream",
    "release_watch": "stream",
    "send_object": "stream",
    "wait_all": "stream",
    "HFEngine": "hf_engine",
    "HFEngineConfig": "config",
    "RolloutBatch": "types",
    "RolloutEngine": "protocol",
    "Sample": "types",
    "SamplingConfig": "config",
    "VLLMConfig": "config",
    "VLLMEngine": "vllm_engine",
    "WeightPublisher": "protocol",
    "WeightSync": "sync",
    "left_pad": "types",
    "logprob_mismatch": "sync",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value  # later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = list(_EXPORTS)
