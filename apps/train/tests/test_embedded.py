"""The embedded default's tokenizer and model: real objects, saved and reloaded."""

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from klppo_train.demo.embedded import (
    answer_accuracy,
    build_model,
    build_tokenizer,
    supervised_batch,
    warm_up,
)
from klppo_train.demo.tasks import make_arithmetic_rows
from klppo_train.runtime.hf_dirs import load_tokenizer, save_atomically

ROW = make_arithmetic_rows(1, seed=0)[0]


def test_tokenizer_is_one_token_per_character_with_a_chat_template() -> None:
    tok = build_tokenizer()
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    text = tok.apply_chat_template(ROW["prompt"], add_generation_prompt=True, tokenize=False)
    assert text == f"user: {ROW['prompt'][0]['content']}\nassistant: "
    ids = tok.apply_chat_template(
        ROW["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert len(ids) == len(text) and tok.decode(ids) == text


def test_supervised_batch_labels_only_the_answer_and_eos() -> None:
    tok = build_tokenizer()
    rows = make_arithmetic_rows(3, seed=0)
    ids, mask, labels = supervised_batch(tok, rows)
    for i, row in enumerate(rows):
        answer = row["reward_model"]["ground_truth"]
        labelled = labels[i][labels[i] != -100].tolist()
        assert tok.decode(labelled[:-1]) == answer and labelled[-1] == tok.eos_token_id
        assert mask[i].sum() == len(labels[i][: int(mask[i].sum())])
        # labels sit on the last len(answer) + 1 valid positions
        end = int(mask[i].sum())
        assert (labels[i][end - len(answer) - 1 : end] != -100).all()


def test_model_shape_suits_vllm_cpu() -> None:
    model = build_model(vocab_size=len(build_tokenizer()), seed=0)
    config = model.config
    assert config.hidden_size // config.num_attention_heads == 32  # vLLM CPU needs >= 32
    assert not config.tie_word_embeddings and config.eos_token_id == 1


def test_warm_up_lowers_the_loss_and_saves_atomically(tmp_path: Path) -> None:
    tok = build_tokenizer()
    model = build_model(len(tok), seed=0)
    result = warm_up(model, tok, make_arithmetic_rows(64, seed=0), max_steps=30, batch_size=16)
    losses = result.losses
    assert result.steps == len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    path = save_atomically(model, tok, tmp_path / "model")
    assert not (tmp_path / "model.tmp").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(path)
    for (name, a), (_, b) in zip(
        model.named_parameters(), reloaded.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    reloaded_tok = load_tokenizer(path)
    prompt = make_arithmetic_rows(1, seed=3)[0]["prompt"]
    as_built = tok.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
    assert (
        reloaded_tok.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
        == as_built
    )
    # AutoTokenizer would pick Qwen2Tokenizer by model type and lose the spaces
    auto = AutoTokenizer.from_pretrained(path)
    assert (
        auto.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False) != as_built
    )


def test_answer_accuracy_is_greedy_decoding() -> None:
    """Teacher-forced argmax accuracy equals what greedy generation actually produces."""
    tok = build_tokenizer()
    model = build_model(len(tok), seed=0)
    rows = make_arithmetic_rows(400, seed=0)
    warm_up(model, tok, rows, max_steps=120, seed=0)
    eval_rows = make_arithmetic_rows(40, seed=5)
    hits = 0
    for row in eval_rows:
        prompt = tok.apply_chat_template(
            row["prompt"], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        out = model.generate(
            **prompt, max_new_tokens=4, do_sample=False, eos_token_id=1, pad_token_id=0
        )
        text = tok.decode(out[0, prompt["input_ids"].shape[1] :])
        hits += text == row["reward_model"]["ground_truth"] + "[EOS]"
    accuracy = answer_accuracy(model, tok, eval_rows)
    assert accuracy == hits / len(eval_rows)
    assert 0 < accuracy < 1  # the comparison is not vacuous


def test_warm_up_stops_at_the_target_accuracy() -> None:
    tok = build_tokenizer()
    model = build_model(len(tok), seed=0)
    rows = make_arithmetic_rows(400, seed=0)
    result = warm_up(
        model, tok, rows, max_steps=300, target_accuracy=0.2, eval_rows=rows[-100:], eval_every=10
    )
    assert result.accuracy >= 0.2 and result.steps < 300 and result.steps % 10 == 0
    assert answer_accuracy(model, tok, rows[-100:]) == result.accuracy


def test_load_tokenizer_honours_the_saved_class(tmp_path: Path) -> None:
    """A plain backend loads as saved (the embedded tokenizer, also from an actor export);
    a model-specific class goes through AutoTokenizer."""
    tok = build_tokenizer()
    tok.save_pretrained(tmp_path / "plain")
    (tmp_path / "plain" / "config.json").write_text(
        build_model(len(tok), seed=0).config.to_json_string()  # a Qwen2 model type
    )
    plain = load_tokenizer(tmp_path / "plain")
    assert plain("1 + 2")["input_ids"] == tok("1 + 2")["input_ids"]  # spaces kept
    tok.save_pretrained(tmp_path / "typed")
    config = tmp_path / "typed" / "tokenizer_config.json"
    saved = json.loads(config.read_text())
    config.write_text(json.dumps({**saved, "tokenizer_class": "Qwen2Tokenizer"}))
    assert type(load_tokenizer(tmp_path / "typed")).__name__ == "Qwen2Tokenizer"
