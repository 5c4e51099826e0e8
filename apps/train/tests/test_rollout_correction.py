"""Rollout correction in real steps (single process, HF engine, tiny embedded model): with the
engine's weights equal to the trainer's the corrected step is the uncorrected one; with the
engine's weights perturbed every key changes the step; and an engine sampling at another
temperature is corrected back to the trainer's expectation (closed form)."""

import math

import pytest
import torch
from test_step import components

from klppo_train.checks.validate import validate_config
from klppo_train.config.data import DataConfig
from klppo_train.config.schema import load_config
from klppo_train.data.datasets import PromptDataset
from klppo_train.demo.embedded import build_model, build_tokenizer
from klppo_train.demo.tasks import make_arithmetic_rows
from klppo_train.ppo.step import ppo_step
from ppo_core import normalize_is_weights, rollout_is_weights
from rollout import HFEngine, HFEngineConfig, SamplingConfig

KEY = "algorithm.rollout_correction."
ON_POLICY = ["actor.ppo_mini_batch_size=4", "algorithm.use_kl_in_reward=false"]
COMPARED = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/vf_loss")


def step(extra: list[str], perturb: float = 0.0) -> dict:
    """One seeded step's metrics; ``perturb``: noise of that scale on the engine's weights
    only (its probabilities then differ from the trainer's)."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    _, c = components(tokenizer, tuple(extra))
    if perturb:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in c.engine.model.parameters():
                p.add_(perturb * torch.randn(p.shape, generator=g))
    items = PromptDataset(
        make_arithmetic_rows(4, seed=0), tokenizer, DataConfig(max_prompt_length=64)
    ).items
    return ppo_step(c, items, step=1)


@pytest.mark.parametrize(
    "extra",
    [
        [f"{KEY}rollout_is=token"],
        [f"{KEY}rollout_is=sequence", f"{KEY}rollout_is_batch_normalize=true"],
        [f"{KEY}rollout_rs=token_k1,seq_max_k3", f"{KEY}rollout_rs_threshold=0.5_2.0,0.1"],
    ],
)
def test_without_a_mismatch_the_corrected_step_is_the_plain_one(extra: list[str]) -> None:
    """fp32, the engine holds the trainer's weights (mismatch ~1e-7): weights 1, nothing
    rejected, the step (losses, gradient norm, entropy) within 1e-5 of the uncorrected
    on-policy step, which skips the old-log-prob pass the corrected one runs."""
    plain = step(ON_POLICY)
    corrected = step([*ON_POLICY, *extra])
    assert "timing_s/old_log_prob" in corrected and "timing_s/old_log_prob" not in plain
    assert corrected["rollout/logprob_diff_max"] < 1e-5
    assert corrected.get("rollout_corr/rollout_rs_masked_fraction", 0.0) == 0.0
    if "rollout_corr/rollout_is_mean" in corrected:
        assert corrected["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-5)
    for name in COMPARED:
        # abs 1e-6: the on-policy pg_loss is -mean(A) ~ 0, float32 rounding of O(1) terms
        assert corrected[name] == pytest.approx(plain[name], rel=1e-5, abs=1e-6), name


def test_every_key_changes_a_mismatched_step() -> None:
    """The engine's weights perturbed (mismatch ~0.1–1): each key moves what it should."""
    base = [*ON_POLICY, "actor.clip_ratio_c=10"]
    plain = step(base, perturb=0.05)
    token = step([*base, f"{KEY}rollout_is=token"], perturb=0.05)
    assert plain["rollout/logprob_diff_max"] > 0.05
    assert 0 < token["rollout_corr/rollout_is_eff_sample_size"] < 1
    assert token["actor/pg_loss"] != pytest.approx(plain["actor/pg_loss"], rel=1e-3)
    results = {
        "sequence": [f"{KEY}rollout_is=sequence"],
        "threshold": [f"{KEY}rollout_is=token", f"{KEY}rollout_is_threshold=1.05"],
        "normalized": [f"{KEY}rollout_is=token", f"{KEY}rollout_is_batch_normalize=true"],
        "rejected": [f"{KEY}rollout_rs=token_k2", f"{KEY}rollout_rs_threshold=0.001"],
        "bypass": [f"{KEY}bypass_mode=true"],
        "reinforce": [f"{KEY}bypass_mode=true", f"{KEY}loss_type=reinforce"],
    }
    got = {
        # REINFORCE has no dual clip: actor.clip_ratio_c would take no effect (refused)
        name: step([*(ON_POLICY if name == "reinforce" else base), *extra], perturb=0.05)
        for name, extra in results.items()
    }
    for name in ("sequence", "threshold", "normalized"):
        assert got[name]["actor/pg_loss"] != pytest.approx(token["actor/pg_loss"], rel=1e-3)
    assert got["threshold"]["rollout_corr/rollout_is_ratio_fraction_high"] > 0
    assert "rollout_corr/rollout_is_batch_norm_factor" in got["normalized"]
    assert 0 < got["rejected"]["rollout_corr/rollout_rs_masked_fraction"] < 1
    assert got["rejected"]["actor/grad_norm"] != pytest.approx(plain["actor/grad_norm"])
    # bypass: no old-log-prob pass, the ratio is to the engine's probabilities (not 1)
    assert "timing_s/old_log_prob" not in got["bypass"]
    assert got["bypass"]["actor/ppo_kl"] != 0.0 and plain["actor/ppo_kl"] == 0.0
    assert got["reinforce"]["actor/pg_loss"] != pytest.approx(got["bypass"]["actor/pg_loss"])
    assert all(math.isfinite(m["actor/grad_norm"]) for m in got.values())


def test_weights_recover_the_trainers_expectation_from_a_hotter_engine() -> None:
    """The HF engine samples one token at temperature 2 (its log-probs are those it sampled
    from); the trainer's policy is temperature 1. E_π[f] over the vocabulary in closed form;
    the plain mean of the samples misses it, the importance-weighted mean recovers it."""
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), seed=0, hidden=64).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # a peaked distribution: temperature matters
    prompt = tokenizer("3+4=")["input_ids"]
    with torch.no_grad():
        log_pi = model(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
    f = torch.arange(log_pi.numel(), dtype=torch.float32) % 7  # any function of the token
    truth = float((log_pi.exp() * f).sum())
    engine = HFEngine(model, HFEngineConfig(pad_token_id=0, eos_token_ids=(1,)))
    sampling = SamplingConfig(n=4000, temperature=2.0, max_new_tokens=1, seed=0)
    batch = engine.generate([prompt], sampling)
    tokens = torch.tensor([s.response_token_ids[0] for s in batch.samples])
    rollout = torch.tensor([s.logprobs[0] for s in batch.samples])[:, None]
    old, mask = log_pi[tokens][:, None], torch.ones(len(tokens), 1)
    weights, _ = rollout_is_weights(old, rollout, mask, threshold=1e9)
    weights = normalize_is_weights(weights, mask)[0][:, 0]  # self-normalized
    plain = float(f[tokens].mean())
    corrected = float((weights * f[tokens]).mean())
    assert abs(plain - truth) > 0.05 and abs(plain - truth) > 5 * abs(corrected - truth)
    assert corrected == pytest.approx(truth, abs=0.1)


def test_bad_keys_fail_before_any_model() -> None:
    for extra, message in (
        ([f"{KEY}rollout_is=geometric"], "rollout_is='geometric'"),
        ([f"{KEY}rollout_is_threshold=3"], "rollout_is_threshold takes effect only"),
        ([f"{KEY}rollout_rs=token_k1"], "needs rollout_rs_threshold"),
        ([f"{KEY}rollout_rs=token_k3", f"{KEY}rollout_rs_threshold=0.1_2"], "no lower bound"),
        ([f"{KEY}loss_type=reinforce"], "loss_type takes effect only"),
        ([f"{KEY}bypass_mode=true", f"{KEY}loss_type=pg"], "valid: ppo_clip, reinforce"),
    ):
        with pytest.raises(ValueError, match=message):
            validate_config(load_config(None, extra))
