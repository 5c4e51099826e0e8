"""verl-format prompt datasets: read and check parquet rows, tokenize prompts, batch them.

A row (one prompt) has the columns verl's example datasets use::

    data_source   str                        picks the reward function
    prompt        list[{role, content}]      chat messages, rendered by the chat template
    ability       str                        free-form tag, e.g. "math"
    reward_model  {style: str, ground_truth: str}
    extra_info    struct, optional           kept as-is and handed to the reward
                                             (and its tools_kwargs to the row's tool calls)
    agent_name    str, optional              multi-turn: the row's agent (tool_agent,
                                             single_turn_agent: klppo_train.agents)

The built-in datasets (arithmetic, GSM8K conversion) and their command line are in
:mod:`klppo_train.demo.tasks`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from klppo_train.config.data import DataConfig

# The values of verl's agent_name column klppo runs (klppo_train.agents.samplers): tools'
# calls answered (the default with multi-turn on), or one assistant turn, never answered.
TOOL_AGENT, SINGLE_TURN_AGENT = "tool_agent", "single_turn_agent"
AGENTS = (TOOL_AGENT, SINGLE_TURN_AGENT)

# ---------------------------------------------------------------------------- rows


def check_row(row: Any, where: str) -> dict[str, Any]:
    """Validate one verl row and return it normalised (extra_info always a dict).

    Raises:
        ValueError: ``"{where}: '<field>' ..."`` for the first missing or mistyped field.
    """
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a dict, got {type(row).__name__}")
    for key in ("data_source", "ability"):
        if not isinstance(row.get(key), str) or not row[key]:
            raise ValueError(f"{where}: {key!r} must be a non-empty str, got {row.get(key)!r}")
    prompt = row.get("prompt")
    if (
        not isinstance(prompt, list | tuple)
        or not prompt
        or not all(_is_message(m) for m in prompt)
    ):
        raise ValueError(
            f"{where}: 'prompt' must be a non-empty list of {{role, content}} messages "
            f"with str values, got {prompt!r}"
        )
    reward = row.get("reward_model")
    if not (
        isinstance(reward, dict) and all(is_str(reward.get(k)) for k in ("style", "ground_truth"))
    ):
        raise ValueError(
            f"{where}: 'reward_model' must be {{style: str, ground_truth: str}}, got {reward!r}"
        )
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"{where}: 'extra_info' must be a dict or missing, got {extra!r}")
    agent = row.get("agent_name")
    if agent is not None and not is_str(agent):
        raise ValueError(f"{where}: 'agent_name' must be a str or missing, got {agent!r}")
    checked = {
        "data_source": row["data_source"],
        "prompt": [{"role": m["role"], "content": m["content"]} for m in prompt],
        "ability": row["ability"],
        "reward_model": {"style": reward["style"], "ground_truth": reward["ground_truth"]},
        "extra_info": dict(extra or {}),
    }
    return checked | ({"agent_name": agent} if agent else {})


def is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_message(message: Any) -> bool:
    return (
        isinstance(message, dict)
        and bool(message.get("role"))
        and all(is_str(message.get(k)) for k in ("role", "content"))
    )


def read_rows(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[dict[str, Any]]:
    """Read and validate verl rows from one or more parquet files, in file order.

    Raises:
        FileNotFoundError: a path does not exist (checked for all before reading any).
        ValueError: no paths, or a bad row, named as ``"<path> row <i>: ..."``.
    """
    return [check_row(row, where) for row, where in read_table_rows(paths)]


def read_table_rows(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
) -> list[tuple[dict[str, Any], str]]:
    """``(row, "<path> row <i>")`` of every row of the parquet files, in file order, for a
    row check to name (:func:`read_rows`; the reward model's preference pairs).

    Raises:
        FileNotFoundError: a path does not exist (checked for all before reading any).
        ValueError: no paths, an unreadable file or one without rows.
    """
    paths = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    paths = [Path(p).expanduser() for p in paths]
    if not paths:
        raise ValueError("read_rows: no parquet files given (is data.train_files empty?)")
    for path in paths:
        if path.is_dir():
            raise IsADirectoryError(f"{str(path)!r} is a directory, not a parquet file")
        if not path.is_file():
            raise FileNotFoundError(f"parquet file {str(path)!r} does not exist")
    rows = []
    for path in paths:
        try:
            table = pq.read_table(path)
        except pa.ArrowException as err:
            raise ValueError(f"{str(path)!r} is not a readable parquet file: {err}") from None
        if not table.num_rows:
            raise ValueError(f"{str(path)!r} has no rows")
        rows += [(r, f"{path} row {i}") for i, r in enumerate(table.to_pylist())]
    return rows


def write_parquet(
    rows: Sequence[dict[str, Any]], path: str | os.PathLike, check: Callable = check_row
) -> None:
    """Validate ``rows`` (``check(row, where)``: a PPO row by default) and write them to
    ``path`` atomically (temp file + ``os.replace``)."""
    if not rows:
        raise ValueError(f"write_parquet: no rows to write to {str(path)!r}")
    rows = [check(r, f"rows[{i}]") for i, r in enumerate(rows)]
    if "extra_info" in rows[0] and not any(r["extra_info"] for r in rows):
        # Parquet cannot store a struct without fields; read_rows treats a missing column as {}.
        rows = [{k: v for k, v in r.items() if k != "extra_info"} for r in rows]
    # every column any row has (from_pylist takes the first row's): agent_name is optional
    columns = list(dict.fromkeys(k for r in rows for k in r))
    table = pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in rows])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------- dataset


@dataclass(frozen=True)
class PromptItem:
    """One tokenized prompt: what generation and the reward read (``index``: its row;
    ``messages``: the conversation, which a reward model with another chat template
    renders itself)."""

    index: int
    data_source: str
    prompt_ids: tuple[int, ...]
    ground_truth: str
    extra_info: dict[str, Any] = field(default_factory=dict)
    messages: tuple[dict[str, str], ...] = ()
    agent_name: str = ""  # the row's (multi-turn); "": the run's default agent


class PromptDataset:
    """Rows rendered with the tokenizer's chat template and fitted to ``max_prompt_length``.

    Args:
        rows: validated rows, e.g. from :func:`read_rows`.
        tokenizer: a HF tokenizer with a ``chat_template``.
        config: length limit, truncation mode and filtering.
        tools: the tools' schemas, rendered into each prompt by the chat template (its
            ``tools`` variable, as verl does) except a ``single_turn_agent`` row's.

    Raises:
        ValueError: the tokenizer has no chat template, or (``truncation="error"`` without
            filtering) a prompt is too long, naming the row index and its length.
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: Any,
        config: DataConfig,
        tools: Sequence[dict[str, Any]] | None = None,
    ):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("PromptDataset: the tokenizer has no chat_template to render prompts")
        self.config = config
        self.tools = list(tools) if tools else None
        self.template_ignores_tools: bool | None = None  # asked on the first row with tools
        self.num_filtered = 0
        self.items: list[PromptItem] = []
        for i, row in enumerate(rows):
            item = self._make_item(i, row, tokenizer)
            if item is None:
                self.num_filtered += 1
            else:
                self.items.append(item)

    def _render(self, row: dict[str, Any], tokenizer: Any) -> list[int]:
        tools = self.tools if row.get("agent_name") != SINGLE_TURN_AGENT else None
        ids = list(
            tokenizer.apply_chat_template(
                row["prompt"],
                tools=tools,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        if tools and self.template_ignores_tools is None:
            plain = tokenizer.apply_chat_template(
                row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            self.template_ignores_tools = list(plain) == ids
        return ids

    def _make_item(self, i: int, row: dict[str, Any], tokenizer: Any) -> PromptItem | None:
        ids = self._render(row, tokenizer)
        limit, mode = self.config.max_prompt_length, self.config.truncation
        overlong = len(ids) > limit
        if overlong and self.config.filter_overlong_prompts:
            return None
        if overlong and mode == "error":
            raise ValueError(
                f"row {i} ({row['data_source']}): prompt has {len(ids)} tokens, over "
                f"max_prompt_length={limit}; set truncation to 'left'/'right' or "
                "filter_overlong_prompts=True"
            )
        if overlong:
            ids = ids[-limit:] if mode == "left" else ids[:limit]
        return PromptItem(
            index=i,
            data_source=row["data_source"],
            prompt_ids=tuple(int(t) for t in ids),
            ground_truth=row["reward_model"]["ground_truth"],
            extra_info=dict(row.get("extra_info") or {}),
            messages=tuple(row["prompt"]),
            agent_name=row.get("agent_name", ""),
        )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]


# ---------------------------------------------------------------------------- loader


class PromptLoader:
    """Full batches of prompts, reshuffled each epoch, with a resumable position.

    Epoch e's order is ``torch.randperm(n)`` from a generator seeded with ``seed + e``, so
    it depends on nothing but (seed, epoch, n). The last incomplete batch of an epoch is
    dropped. Iterating yields the rest of the current epoch; ``next_batch`` rolls over.

    Args:
        dataset: anything with ``len`` and integer indexing.
        batch_size: items per batch, >= 1 and <= ``len(dataset)``.
        seed: base seed of the per-epoch shuffle.
        shuffle: False keeps dataset order every epoch.
    """

    def __init__(
        self, dataset: Sequence[Any], batch_size: int, seed: int = 1, shuffle: bool = True
    ):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"PromptLoader: batch_size must be an int >= 1, got {batch_size!r}")
        if len(dataset) < batch_size:
            raise ValueError(
                f"PromptLoader: the dataset has {len(dataset)} items, fewer than one "
                f"batch of batch_size={batch_size}"
            )
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self._epoch, self._index = 0, 0
        self._order: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.dataset) // self.batch_size

    def _epoch_order(self) -> list[int]:
        if self._order is None or self._order[0] != self._epoch:
            n = len(self.dataset)
            if self.shuffle:
                import torch  # here, not at the top: the data checks run before torch loads

                gen = torch.Generator().manual_seed(self.seed + self._epoch)
                order = torch.randperm(n, generator=gen).tolist()
            else:
                order = list(range(n))
            self._order = (self._epoch, order)
        return self._order[1]

    def next_batch(self) -> list[Any]:
        """The next full batch, moving on to the next epoch after the last one."""
        order = self._epoch_order()
        batch = [self.dataset[j] for j in order[self._index : self._index + self.batch_size]]
        self._index += self.batch_size
        self._roll_over()
        return batch

    def _roll_over(self) -> None:
        # Done eagerly so a checkpoint taken after an epoch's last batch reads (epoch+1, 0).
        if self._index + self.batch_size > len(self.dataset):
            self._epoch, self._index = self._epoch + 1, 0

    def __iter__(self) -> Iterator[list[Any]]:
        epoch = self._epoch
        while self._epoch == epoch:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "index"}``: ``index`` is the next item position in the epoch's order."""
        return {"epoch": self._epoch, "index": self._index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a position from :meth:`state_dict` (same dataset, seed and shuffle)."""
        for key in ("epoch", "index"):
            value = state.get(key) if isinstance(state, dict) else None
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"PromptLoader state {key!r} must be an int >= 0, got {value!r}")
        if state["index"] > len(self.dataset):
            raise ValueError(
                f"PromptLoader state 'index'={state['index']} exceeds the dataset size "
                f"{len(self.dataset)}"
            )
        self._epoch, self._index = state["epoch"], state["index"]
        self._roll_over()
