"""Shared by the FSDP tests and workers: tiny HF models built from a config (no downloads),
and the 2-process torchrun launcher."""

import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 128
HERE = Path(__file__).parent


def tiny_qwen2(seed: int = 0, tie: bool = False, layers: int = 2) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).float()


def tiny_llama(seed: int = 0, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).float()


def batch(seed: int = 1, rows: int = 4, length: int = 16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (rows, length), generator=gen)


def torchrun(script: str, *args: str, timeout: int = 300) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(HERE / script),
        *args,
    ]
    # faulthandler: a crashing rank prints its Python stack into the assertion message
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
