"""The loss mask says one thing: a hand-made trajectory whose loss mask has interior zeros (a
tool's output inside a response) is trained only on its loss tokens by every consumer the
step builds (advantages, KL in the reward, the losses, their token counts, the metrics),
while the budgets and the attention see every token."""

import copy
from dataclasses import replace

import pytest
import torch
from test_step import components

from klppo_train.demo.embedded import build_tokenizer
from klppo_train.ppo.step import _step_metrics
from klppo_train.runtime.process_group import LOSS_TOKENS, global_metrics
from klppo_train.workers.losses import GlobalCounts
from klppo_train.workers.trajectories import Trajectories
from ppo_core import token_level_scores
from rollout import RolloutBatch, Sample

P, T, N = 6, 8, 4
# rows: a tool's output at 2..4 (row 0), at 1 and 5 (row 1), none (rows 2, 3); lengths vary
LOSS = torch.tensor(
    [[1, 1, 0, 0, 0, 1, 1, 0], [1, 0, 1, 1, 1, 0, 1, 1], [1, 1, 1, 0, 0, 0, 0, 0], [1] * 8]
)
RESPONSE = torch.tensor([[1] * 7 + [0], [1] * 8, [1, 1, 1, 0, 0, 0, 0, 0], [1] * 8])


def _trajectories(vocab: int, seed: int = 0) -> Trajectories:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (N, P + T), generator=g)
    attention = torch.cat([torch.ones(N, P, dtype=torch.long), RESPONSE], 1)
    return Trajectories(
        input_ids=ids * attention,
        attention_mask=attention,
        response_mask=RESPONSE,
        loss_mask=LOSS,
        engine_logprobs=-torch.rand(N, T, generator=g) * LOSS,
        prompt_index=torch.tensor([0, 0, 1, 1]),
        old_logprobs=-torch.rand(N, T, generator=g),
        ref_logprobs=-torch.rand(N, T, generator=g),
        values=torch.randn(N, T, generator=g),
        advantages=torch.randn(N, T, generator=g),
        returns=torch.randn(N, T, generator=g),
    )


def _off_mask(t: Trajectories, *fields: str) -> Trajectories:
    """``t`` with the named tensors changed wildly where the loss mask is 0."""
    off = (LOSS == 0).float()
    return replace(t, **{f: getattr(t, f) + off * (7.0 + i) for i, f in enumerate(fields)})


@pytest.fixture(scope="module")
def built():
    tokenizer = build_tokenizer()
    _, c = components(tokenizer, ("algorithm.adv_estimator=gae",))
    return c, len(tokenizer)


def _grads(trainee, t: Trajectories) -> list[torch.Tensor]:
    trainee = copy.deepcopy(trainee)
    trainee.accumulate(t, max_tokens=10_000)
    return [p.grad.clone() for p in trainee.model.parameters() if p.grad is not None]


def test_sample_loss_masks_reach_the_trajectories() -> None:
    samples = [
        Sample(0, (5, 6, 7, 8), (-0.1,) * 4, "stop", 0, loss_mask=(1, 0, 0, 1)),
        Sample(0, (5, 6), (-0.1,) * 2, "stop", 0),
    ]
    batch = RolloutBatch(samples, 0)
    assert batch.loss_masks(5).tolist() == [[1, 0, 0, 1, 0], [1, 1, 0, 0, 0]]
    assert batch.response_tensors(0, 5)[2].tolist() == [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2"):
        Sample(0, (5, 6), (-0.1,) * 2, "stop", 0, loss_mask=(1,))


def test_the_losses_see_only_loss_tokens(built) -> None:
    c, vocab = built
    t = _trajectories(vocab)
    changed = _off_mask(t, "advantages", "old_logprobs", "ref_logprobs", "values", "returns")
    for trainee in (c.actor, c.critic):
        for a, b in zip(_grads(trainee, t), _grads(trainee, changed), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    counts = GlobalCounts.of(t.loss_mask)  # token means count the loss tokens only
    assert int(counts.global_num_tokens) == int(LOSS.sum()) == 21
    # the entropy metric: a mean over the loss tokens
    loss, metrics = c.actor.loss(c.actor.model, replace(t, old_logprobs=None), counts)
    assert torch.isfinite(loss)
    _, everything = c.actor.loss(c.actor.model, replace(t, loss_mask=RESPONSE), counts)
    assert float(metrics["entropy"]) != pytest.approx(float(everything["entropy"]), abs=1e-6)


def _compacted(x: torch.Tensor) -> torch.Tensor:
    """Each row's loss tokens moved to the front (the masked ones dropped), zero-padded."""
    out = torch.zeros_like(x)
    for row in range(N):
        kept = x[row][LOSS[row].bool()]
        out[row, : len(kept)] = kept
    return out


def test_scores_kl_and_advantages_skip_masked_tokens(built) -> None:
    c, vocab = built
    t = _trajectories(vocab)
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5])
    # the score sits on each row's last loss token
    token_scores = token_level_scores(scores, t.loss_mask)
    last = [int(torch.nonzero(LOSS[r]).max()) for r in range(N)]
    assert token_scores.sum(-1).tolist() == scores.tolist()
    assert [float(token_scores[r, last[r]]) for r in range(N)] == scores.tolist()
    # KL in the reward: the mean KL over loss tokens; none on the masked ones
    kl_in_reward = replace(c.kl_in_reward, controller=copy.deepcopy(c.kl_controller))
    rewards, kl = kl_in_reward(token_scores, t.old_logprobs, t.ref_logprobs, t.loss_mask)
    per_row = ((t.old_logprobs - t.ref_logprobs) * LOSS).sum(-1) / LOSS.sum(-1)
    assert kl["actor/reward_kl_penalty"] == pytest.approx(float(per_row.mean()), rel=1e-5)
    assert torch.equal(rewards * (1 - LOSS), torch.zeros(N, T))
    # GAE's convention: masked tokens are skipped (the recursion passes over them), so the
    # loss tokens' advantages equal those of the same tokens with the masked ones removed
    advantages, _ = c.advantage_fn(rewards, t.loss_mask, values=t.values)
    compact, _ = c.advantage_fn(_compacted(rewards), _compacted(LOSS), values=_compacted(t.values))
    torch.testing.assert_close(_compacted(advantages), compact * _compacted(LOSS))
    # and nothing at a masked position moves them
    changed = _off_mask(t, "old_logprobs", "ref_logprobs", "values")
    rewards2, _ = kl_in_reward(token_scores, changed.old_logprobs, changed.ref_logprobs, LOSS)
    again, _ = c.advantage_fn(rewards2, LOSS, values=changed.values)
    torch.testing.assert_close(advantages * LOSS, again * LOSS)


def test_metrics_count_loss_tokens_and_budgets_every_token(built) -> None:
    c, vocab = built
    t = _trajectories(vocab)
    scores = torch.zeros(N, T)
    metrics = _step_metrics(t, scores)
    assert metrics["response_length/mean"] == float(RESPONSE.sum(-1).float().mean())
    want = float((t.advantages * LOSS).sum() / LOSS.sum())
    assert metrics["critic/advantages/mean"] == pytest.approx(want, rel=1e-6)
    # the ranks' token means are weighted by their loss tokens; the weight is not logged
    assert metrics[LOSS_TOKENS] == 21 and metrics["perf/response_tokens"] == 26
    assert LOSS_TOKENS not in global_metrics(metrics)
    # the micro-batches are cut by the computed tokens, whatever is trained on
    plan = c.actor._plan(t, max_tokens=2 * (P + T))
    assert plan == c.actor._plan(replace(t, loss_mask=RESPONSE), max_tokens=2 * (P + T))
    assert len(plan) == 2  # 13 + 14 + 9 + 14 computed tokens, two rows a micro-batch
