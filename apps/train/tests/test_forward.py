"""Packed, micro-batched response log-probs equal a plain padded forward, with transformers'
``sdpa`` (block-diagonal mask) and with the trainer's ``klppo_varlen`` attention."""

import pytest
import torch
from train_testing import prompt_response_batch

from klppo_train.demo.embedded import build_model
from klppo_train.runtime.packed_attention import VARLEN
from klppo_train.workers.forward import response_logprobs, response_values

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


def tiny_critic(attention: str):
    from transformers import Qwen2ForTokenClassification

    config = build_model(VOCAB, seed=0, hidden=64).config
    config.num_labels = 1
    torch.manual_seed(1)
    critic = Qwen2ForTokenClassification(config).eval()
    critic.set_attn_implementation(attention)
    return critic


@ATTENTION
def test_critic_values_match_the_padded_forward(attention: str) -> None:
    critic = tiny_critic(attention)
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

    monkeypatch.setattr("klppo_train.runtime.packed_attention.sdpa_mask", recording)
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


def grouped_batch(n: int = 3):
    """``batch()``'s prompts, each with ``n`` different responses, rows shuffled."""
    ids, mask, _ = batch()
    ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
    responses, _ = prompt_response_batch([0] * ids.shape[0], [5, 2, 0, 4, 3] * n, P, T, VOCAB)
    ids[:, P:], mask[:, P:] = responses[:, P:], (responses[:, P:] > 0).long()
    order = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(2))
    return ids[order], mask[order], mask[order][:, P:]


def tokens_run(model) -> list[int]:
    """Record how many tokens each forward of ``model`` embeds."""
    counts: list[int] = []
    model.get_input_embeddings().register_forward_hook(
        lambda module, args, out: counts.append(args[0].numel())
    )
    return counts


@pytest.mark.parametrize("max_tokens", [20, 1000])
def test_shared_prompts_run_each_prompt_once_with_the_same_logprobs_and_gradients(max_tokens):
    """``model.share_prompts``: a prompt's samples share its tokens in the packed row; the
    log-probs, entropies and gradients are those of the padded forward, and fewer tokens
    run through the model."""
    ids, mask, response_mask = grouped_batch()
    valid = response_mask.bool()
    results = {}
    for share in (False, True):
        model = tiny_model(VARLEN)
        counts = tokens_run(model)
        got, entropy = response_logprobs(
            model, ids, mask, T, max_tokens=max_tokens, with_entropy=True, share_prompts=share
        )
        (got * response_mask).sum().backward()
        grads = [p.grad for p in model.parameters()]
        results[share] = (got[valid], entropy[valid], grads, sum(counts))
    want, want_entropy = padded_reference(tiny_model("sdpa"), ids, mask, 1.0)
    shared, plain = results[True], results[False]
    torch.testing.assert_close(shared[0], want[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(shared[1], want_entropy[valid], atol=1e-5, rtol=0)
    for a, b in zip(shared[2], plain[2], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert plain[3] == int(mask.sum())
    # prompts of 6, 3, 4, 1, 5 tokens, 3 samples each: all but one token per prompt runs once
    saved = 2 * sum(p - 1 for p in [6, 3, 4, 1, 5])
    assert shared[3] == int(mask.sum()) - saved if max_tokens == 1000 else shared[3] < plain[3]


def test_shared_critic_values_match() -> None:
    critic = tiny_critic(VARLEN)
    ids, mask, response_mask = grouped_batch()
    with torch.no_grad():
        got = response_values(critic, ids, mask, T, max_tokens=30, share_prompts=True)
        want = response_values(critic, ids, mask, T, max_tokens=30)
    valid = response_mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=0)


def test_a_shared_packing_needs_its_layout_and_the_varlen_attention() -> None:
    """Never silently wrong: sdpa would attend across the samples of a shared packing, and
    a shared packing whose layout did not reach klppo_varlen would lose its prompt."""
    from batching import pack_shared_prompts

    ids, mask, _ = grouped_batch()
    with pytest.raises(ValueError, match="share_prompts needs the klppo_varlen attention"):
        response_logprobs(tiny_model("sdpa"), ids, mask, T, max_tokens=1000, share_prompts=True)
    p = pack_shared_prompts(ids, mask, P)
    without_layout = {"input_ids": p.input_ids, "position_ids": p.position_ids, "use_cache": False}
    with pytest.raises(ValueError, match="must start at position 0"), torch.no_grad():
        tiny_model(VARLEN)(**without_layout)
