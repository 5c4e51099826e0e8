"""Tiny models and the trainer-side log-prob recompute shared by the rollout tests."""

import os

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

# vLLM inspects a model once per cache root (+28 s with an empty cache): keep it across runs.
os.environ.setdefault("VLLM_CACHE_ROOT", "/tmp/klppo_vllm_cache")

EOS, PAD, VOCAB = 1, 0, 128


def tiny_model(seed: int = 0, tie: bool = False) -> Qwen2ForCausalLM:
    """Qwen2 with head_dim 32 (vLLM's CPU attention refuses head_dim < 32)."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
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
