"""Packed, micro-batched response log-probs equal a plain padded forward, with transformers'
``sdpa`` (block-diagonal mask) and with the trainer's ``klppo_varlen`` attention."""

import pytest
import torch
from train_testing import prompt_response_batch

from klppo_train.attention import VARLEN
from klppo_train.demo.embedded import build_model
from klppo_train.forward import response_logprobs, response_values

P, T, VOCAB = 6, 5, 64
ATTENTION = pytest.mark.parametrize("attention", ["sdpa", VARLEN])


def tiny_model(attention: str, **kwargs):
    model = build_model(VOCAB, seed=0, hidden=64, **kwargs)
    model.set_attn_implementation(attention)
    return model


def batch():
    ids, mask = prompt_response_batch([6, 3, 4, 1, 5], [5, 2, 0, 4, 3], P, T, VOCAB)
    return ids, mask, mask[:, P:]


def padded_reference(model, ids, mask, temperature):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    logits = logits[:, P - 1 : P + T - 1].float() / temperature
    logp = torch.log_softmax(logits, -1)
    chosen = logp.gather(-1, ids[:, P:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return chosen, entropy


@ATTENTION
@pytest.mark.parametrize("max_tokens", [11, 16, 1000])  # 5, 4 and 1 micro-batches
def test_matches_the_padded_forward(max_tokens: int, attention: str) -> None:
    model = tiny_model(attention).eval()
    ids, mask, response_mask = batch()
    got, entropy = response_logprobs(
        model, ids, mask, T, max_tokens=max_tokens, temperature=0.7, with_entropy=True
    )
    want, want_entropy = padded_reference(model, ids, mask, 0.7)
    valid = response_mask.bool()
    assert valid.sum() == 14
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy[valid], want_entropy[valid], atol=1e-5, rtol=0)


@ATTENTION
def test_gradients_flow_and_match(attention: str) -> None:
    ids, mask, response_mask = batch()
    models = [tiny_model(attention), tiny_model("sdpa")]
    got, _ = response_logprobs(models[0], ids, mask, T, max_tokens=16)
    want, _ = padded_reference(models[1], ids, mask, 1.0)
    (got * response_mask).sum().backward()
    (want * response_mask).sum().backward()
    for (name, a), (_, b) in zip(
        models[0].named_parameters(), models[1].named_parameters(), strict=True
    ):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)


@ATTENTION
def test_critic_values_match_the_padded_forward(attention: str) -> None:
    from transformers import Qwen2ForTokenClassification

    config = build_model(VOCAB, seed=0, hidden=64).config
    config.num_labels = 1
    torch.manual_seed(1)
    critic = Qwen2ForTokenClassification(config).eval()
    critic.set_attn_implementation(attention)
    ids, mask, response_mask = batch()
    got = response_values(critic, ids, mask, T, max_tokens=16)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    padded = critic(input_ids=ids, attention_mask=mask, position_ids=positions).logits[..., 0]
    want = padded[:, P - 1 : P + T - 1]
    valid = response_mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=0)


def test_varlen_attention_never_builds_a_token_by_token_mask(monkeypatch) -> None:
    """The packed forward under klppo_varlen asks transformers for no mask (sdpa's would be
    [nnz, nnz]); a padded forward still gets its padding mask."""
    import transformers.masking_utils as masking

    sizes = []
    real = masking.sdpa_mask

    def recording(*args, **kwargs):
        mask = real(*args, **kwargs)
        sizes.append(None if mask is None else tuple(mask.shape))
        return mask

    monkeypatch.setattr("klppo_train.attention.sdpa_mask", recording)
    model = tiny_model(VARLEN).eval()
    ids, mask, _ = batch()
    with torch.no_grad():
        response_logprobs(model, ids, mask, T, max_tokens=1000)
        assert sizes == []
        model(input_ids=ids, attention_mask=mask)
    assert sizes == [(5, 1, P + T, P + T)]


def test_varlen_attention_finds_the_sequences_from_position_ids_alone() -> None:
    """A packed call without the cu_seq_lens kwargs (e.g. a caller's own packing) still keeps
    each sequence to itself: boundaries come from the restarting position ids."""
    from batching import pack

    ids, mask, _ = batch()
    p = pack(ids, mask)
    plain = {"input_ids": p.input_ids, "position_ids": p.position_ids, "use_cache": False}
    with torch.no_grad():
        got = tiny_model(VARLEN).eval()(**plain).logits
        want = tiny_model("sdpa").eval()(**plain).logits  # HF's block-diagonal mask
        cross = tiny_model(VARLEN).eval()(input_ids=p.input_ids, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert not torch.allclose(cross, want, atol=1e-3)  # arange positions: one long sequence
