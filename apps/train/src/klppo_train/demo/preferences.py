"""A preference data set a 135M reward model can learn: SmolLM2's own answers to the
arithmetic task, ranked by the rule (``data.source=smollm2_arith_preferences``).

Why this one: it is what RLHF does -- preferences over the policy's own samples -- and the
rule stands in for the labeler, so the held-out rule accuracy of the RLHF run shows whether
the reward model is being exploited. For each problem the base model (at the PPO recipe's
sampling: temperature 1, 24 tokens) answers 8 times, 4 of them asked plainly and 4 asked to
"Answer briefly." (every pair shows the plain question: the brief answers stand for what
the policy can learn to say); a right answer (finished, last number correct) and a wrong
one (a wrong last number, or cut at 24 tokens: its last number is not a final answer) of
the same problem make a pair (up to 3 per problem). Asked plainly the model mostly explains
at length and is cut; the right answers are mostly the short "7 * 8 = 56" kind. The pairs
differ in form and in the number, so the reward model can learn both.

Problems: the ``arithmetic_chat`` training problems (never its 120 validation ones), split
once more: 60 problems' pairs are the reward model's held-out set. Generation: vLLM on the
CPU, ~2 minutes on 2 cores, once per run directory.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

from fsdp_sharding import default_device
from klppo_train.data.rewards import arithmetic_final_number_score
from klppo_train.demo.tasks import DATA_SOURCES
from klppo_train.runtime.hf_dirs import load_tokenizer
from klppo_train.runtime.precision import resolve_precision

log = logging.getLogger("klppo_train")
SAMPLES, MAX_PAIRS, VAL_PROBLEMS, RESPONSE_TOKENS = 8, 3, 60, 24
BRIEF = " Answer briefly."


def _problems() -> list[dict[str, Any]]:
    """The distinct training problems of ``arithmetic_chat``, in a fixed shuffled order."""
    train, _ = DATA_SOURCES["arithmetic_chat"]()
    unique = {r["prompt"][0]["content"]: r for r in train}
    problems = [unique[k] for k in sorted(unique)]
    random.Random(0).shuffle(problems)
    return problems


def _pairs(row: dict[str, Any], answers: list[tuple[str, bool]]) -> list[dict[str, Any]]:
    """Right answers against wrong ones of one problem; an answer cut at the length limit
    counts as wrong (its last number is not a final answer)."""
    truth = row["reward_model"]["ground_truth"]
    good = [ended and arithmetic_final_number_score(a, truth) == 1.0 for a, ended in answers]
    right = [a for (a, _), ok in zip(answers, good, strict=True) if ok]
    wrong = [a for (a, _), ok in zip(answers, good, strict=True) if not ok]
    return [
        {"prompt": row["prompt"], "chosen": c, "rejected": r, "data_source": row["data_source"]}
        for c, r in list(zip(right, wrong, strict=False))[:MAX_PAIRS]
    ]


def _sample(model_path: Path, rows: list[dict[str, Any]]) -> list[list[tuple[str, bool]]]:
    """``SAMPLES`` answers of the base model to each row (vLLM, seeded): ``(text, ended)``
    (ended: with EOS, not cut at ``RESPONSE_TOKENS``), half of them asked plainly, half
    with ``BRIEF`` appended to the question (its concise answers are right more often)."""
    from rollout import SamplingConfig, VLLMConfig, VLLMEngine

    tokenizer = load_tokenizer(model_path)
    asked = [
        [{"role": "user", "content": r["prompt"][0]["content"] + suffix}]
        for suffix in ("", BRIEF)
        for r in rows
    ]
    prompts = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=False)
        for m in asked
    ]
    # bf16 where this CPU is faster in it (as model.dtype=auto picks for the PPO recipe)
    dtype = resolve_precision("auto", default_device()).name
    config = VLLMConfig(max_model_len=128, kv_cache_space_gib=0.5, seed=0, dtype=dtype)
    engine = VLLMEngine(model_path, config)
    try:
        sampling = SamplingConfig(n=SAMPLES // 2, temperature=1.0, max_new_tokens=RESPONSE_TOKENS)
        batch = engine.generate(prompts, sampling, seeds=list(range(len(prompts))))
    finally:
        engine.close()
    answers: list[list[tuple[str, bool]]] = [[] for _ in rows]
    for s in batch.samples:
        text = tokenizer.decode(list(s.response_token_ids), skip_special_tokens=True)
        answers[s.prompt_index % len(rows)].append((text, s.finish_reason == "stop"))
    return answers


def smollm2_preferences(model_path: Path) -> tuple[list[dict], list[dict]]:
    """``(train pairs, held-out pairs)`` of the base model at ``model_path``."""
    problems = _problems()
    answers = _sample(model_path, problems)
    pairs = [_pairs(row, a) for row, a in zip(problems, answers, strict=True)]
    val = [p for ps in pairs[:VAL_PROBLEMS] for p in ps]
    train = [p for ps in pairs[VAL_PROBLEMS:] for p in ps]
    log.info(
        "smollm2_arith_preferences: %d training and %d held-out pairs from %d problems "
        "(%d answers each)", len(train), len(val), len(problems), SAMPLES,
    )  # fmt: skip
    return train, val
