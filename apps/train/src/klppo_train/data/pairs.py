"""Preference pairs: read and check parquet rows, tokenize them (their batches in verl's
layout: :func:`klppo_train.reward_model.training.pair_batch`).

A row is one comparison. The conventional shape (OpenRLHF's, TRL's explicit-prompt one)::

    prompt    list[{role, content}] | str     the conversation so far (a str: one user turn)
    chosen    list[{role, content}] | str     the preferred assistant response
    rejected  list[{role, content}] | str     the other one
    margin    float, optional                 how much better chosen is (Llama 2's margin)

A response given as messages is its last message, which must be the assistant's. Also
accepted, TRL's implicit-prompt shape: no ``prompt`` column, ``chosen`` and ``rejected``
full conversations that share every message but the final assistant one.

Each response is tokenized as the policy would have generated it after the prompt (the chat
template with its generation prompt): the text's tokens, then EOS -- so the score is read at
the same token in training and in PPO, the response's last one (EOS, or the last kept token
of a response cut at ``reward_training.max_response_length``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from klppo_train.data.datasets import read_table_rows

Messages = list[dict[str, str]]


def _messages(value: Any, where: str, column: str) -> Messages:
    if isinstance(value, str) and value:
        return [{"role": "user" if column == "prompt" else "assistant", "content": value}]
    ok = (
        isinstance(value, list | tuple)
        and value
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )
    )
    if not ok:
        raise ValueError(
            f"{where}: {column!r} must be a non-empty str or list of {{role, content}} "
            f"messages, got {value!r}"
        )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _split_implicit(chosen: Messages, rejected: Messages, where: str) -> Messages:
    """The prompt two full conversations share (TRL's implicit-prompt rows)."""
    if chosen[:-1] != rejected[:-1] or len(chosen) < 2:
        raise ValueError(
            f"{where}: without a 'prompt' column, 'chosen' and 'rejected' must be whole "
            "conversations that differ only in their last (assistant) message"
        )
    return chosen[:-1]


def check_pair_row(row: Any, where: str) -> dict[str, Any]:
    """One preference row, normalised to ``{prompt: messages, chosen: str, rejected: str,
    margin: float}``; ValueError ``"{where}: ..."`` naming the first bad column."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a dict, got {type(row).__name__}")
    chosen = _messages(row.get("chosen"), where, "chosen")
    rejected = _messages(row.get("rejected"), where, "rejected")
    if row.get("prompt") is None:
        prompt = _split_implicit(chosen, rejected, where)
    else:
        prompt = _messages(row["prompt"], where, "prompt")
    responses = {}
    for column, messages in (("chosen", chosen), ("rejected", rejected)):
        if messages[-1]["role"] != "assistant":
            raise ValueError(f"{where}: the last message of {column!r} must be the assistant's")
        responses[column] = messages[-1]["content"]
    margin = row.get("margin")
    margin = 0.0 if margin is None else margin
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not math.isfinite(margin):
        raise ValueError(f"{where}: 'margin' must be a finite number or missing, got {margin!r}")
    return {"prompt": prompt, **responses, "margin": float(margin)}


def read_pairs(paths: Sequence[str]) -> list[dict[str, Any]]:
    """Checked preference rows of parquet files (errors name ``<file> row <i>``)."""
    return [check_pair_row(row, where) for row, where in read_table_rows(paths)]


@dataclass(frozen=True)
class Pair:
    """One tokenized comparison: the prompt's ids and the two responses' ids."""

    index: int
    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]
    margin: float = 0.0


def response_ids(tokenizer, text: str, max_length: int) -> tuple[int, ...]:
    """The response as generated: its text's tokens, then EOS; cut to ``max_length``."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return tuple(ids[:max_length])


class PairDataset:
    """Rows rendered with the tokenizer's chat template; pairs whose prompt is longer than
    ``max_prompt_length`` are dropped and counted (``num_filtered``)."""

    def __init__(self, rows, tokenizer, max_prompt_length: int, max_response_length: int):
        self.pairs: list[Pair] = []
        self.num_filtered = 0
        for i, row in enumerate(rows):
            prompt = tokenizer.apply_chat_template(
                row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            if len(prompt) > max_prompt_length:
                self.num_filtered += 1
                continue
            chosen, rejected = (
                response_ids(tokenizer, row[k], max_response_length) for k in ("chosen", "rejected")
            )
            self.pairs.append(Pair(i, tuple(prompt), chosen, rejected, row["margin"]))

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> Pair:
        return self.pairs[index]
