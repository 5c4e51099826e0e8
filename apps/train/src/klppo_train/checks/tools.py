"""The multi-turn checks of the preflight (:mod:`klppo_train.checks.preflight`): the tools
of ``rollout.multi_turn.tool_config_path`` loaded, the rows' ``agent_name``, and the chat
template's turns -- all before any model loads, each error one line naming the key or row."""

from __future__ import annotations

from klppo_train.config.errors import UserError, user_errors
from klppo_train.config.schema import MultiTurnSection
from klppo_train.data.datasets import AGENTS, TOOL_AGENT, PromptDataset


def check_agents(multi_turn: bool, key: str, dataset: PromptDataset) -> None:
    """A row's ``agent_name`` is one klppo runs, and a tool agent only with tools on."""
    for item in dataset.items:
        if item.agent_name and item.agent_name not in AGENTS:
            raise UserError(
                f"data.{key} row {item.index}: agent_name={item.agent_name!r} is not one of "
                f"{', '.join(AGENTS)}"
            )
        if item.agent_name == TOOL_AGENT and not multi_turn:
            raise UserError(
                f"data.{key} row {item.index}: agent_name={TOOL_AGENT} needs "
                "rollout.multi_turn.enable=true (and its tool_config_path)"
            )


def load_tools(mt: MultiTurnSection) -> list | None:
    """The multi-turn rollout's tools, loaded from ``tool_config_path`` (a user's class is
    imported and built here), or None when it is off."""
    if not mt.enable:
        return None
    from klppo_train.agents.tool_config import load_tool_config  # torch-free

    with user_errors(f"rollout.multi_turn.tool_config_path={mt.tool_config_path!r}: "):
        return load_tool_config(mt.tool_config_path)


def check_turns(model_path: str, tokenizer) -> None:
    """The chat template can append tool turns to the engine's ids without re-rendering
    them (:class:`rollout.TurnRenderer`'s start-up check)."""
    from rollout.chat import TurnRenderer  # torch-free

    where = model_path or "the embedded model"
    with user_errors(f"rollout.multi_turn.enable=true with the tokenizer of {where}: "):
        TurnRenderer(tokenizer)
