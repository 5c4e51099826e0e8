"""Tiny models and the trainer-side log-prob recompute shared by the rollout tests."""

import os

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

# vLLM inspects a model once per cache root (+28 s with an empty cache): keep it across runs.
os.environ.setdefault("VLLM_CACHE_ROOT", "/tmp/klppo_vllm_cache")

EOS, PAD, VOCAB = 1, 0, 128


def tiny_model(seed: int = 0, tie: bool = False, vocab_size: int = VOCAB) -> Qwen2ForCausalLM:
    """Qwen2 with head_dim 32 (vLLM's CPU attention refuses head_dim < 32)."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=EOS,
        bos_token_id=EOS,
        pad_token_id=PAD,
    )
    return Qwen2ForCausalLM(config).float().eval()


def recompute_logprobs(
    model, prompt: list[int], response: tuple[int, ...], temperature: float = 1.0
) -> torch.Tensor:
    """The trainer's view: log softmax(logits / τ) of each response token, teacher-forced."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]


# A ChatML template without a default system prompt (SmolLM2's, Qwen2.5's shape).
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PAIRS = [(3, 4), (6, 7), (12, 5), (9, 8)]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%d*%d"}}</tool_call>'


def chat_tokenizer():
    """A byte-level BPE tokenizer (320 ids: <pad> 0, <|im_end|> 1 = EOS, <|im_start|> 2)
    trained here on calculator conversations, with a ChatML template. Its merges make
    decode→encode of sampled ids differ from the ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [f"What is {a}*{b}?" + CALL % (a, b) + f"The answer is {a * b}." for a, b in PAIRS]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<pad>", "<|im_end|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus * 5, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHATML
    return tokenizer


def chat_prompt(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def chat_model(tokenizer, seed: int = 0) -> Qwen2ForCausalLM:
    """A random :func:`tiny_model` over ``tokenizer``'s ids (EOS 1, pad 0 as there)."""
    return tiny_model(seed, vocab_size=len(tokenizer))


def tool_model(tokenizer, renderer, steps: int = 120) -> Qwen2ForCausalLM:
    """:func:`chat_model` taught (a few seconds of AdamW on the assistant tokens only) to
    answer "What is a*b?" for :data:`PAIRS` by calling the calculator, then "The answer is
    <its answer>." — so a real model emits real hermes calls."""
    rows = []
    for a, b in PAIRS:
        prompt = chat_prompt(tokenizer, f"What is {a}*{b}?")
        call = tokenizer.encode(CALL % (a, b), add_special_tokens=False) + [1]
        answer = renderer.ids([{"role": "tool", "content": str(a * b)}])
        final = tokenizer.encode(f"The answer is {a * b}.", add_special_tokens=False) + [1]
        ids = prompt + call + answer + final
        learn = [0] * len(prompt) + [1] * len(call) + [0] * len(answer) + [1] * len(final)
        rows.append((ids, learn))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (row, learn) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        labels[i, : len(row)] = torch.tensor(
            [t if k else -100 for t, k in zip(row, learn, strict=False)]
        )
    model = chat_model(tokenizer).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def assert_well_formed(sample, tokenizer, renderer) -> None:
    """Turns cover the response in order; mask 1 exactly on assistant turns, engine
    log-probs 0 on the others; an appended turn is the renderer's text, ids as rendered."""
    assert sample.turns[0].start == 0 and sample.turns[-1].end == len(sample.response_token_ids)
    for before, after in zip(sample.turns, sample.turns[1:], strict=False):
        assert before.end == after.start
    for turn in sample.turns:
        span = slice(turn.start, turn.end)
        generated = turn.role == "assistant"
        assert set(sample.loss_mask[span]) == {int(generated)}
        if not generated:
            assert set(sample.logprobs[span]) == {0.0}
            if turn is sample.turns[-1] and sample.finish_reason == "length":
                continue  # an answer cut at the response budget
            text = tokenizer.decode(sample.response_token_ids[span])
            assert text.startswith("\n<|im_start|>" + turn.role + "\n")
            assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
            content = text.split("\n")[2].removesuffix("<|im_end|>")
            assert list(sample.response_token_ids[span]) == renderer.ids(
                [{"role": turn.role, "content": content}]
            )


class UserTurns:
    """An environment that is not tool calling: a user who always says "go on"."""

    def wants_turn(self, text, context):
        return True

    def respond(self, texts, contexts):
        from rollout import Observation

        return [Observation(({"role": "user", "content": "go on"},)) for _ in texts]
