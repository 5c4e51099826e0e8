"""LoRA on the actor (model.lora_rank): exact at zero, the reference is the base model, the
merge equals peft's, only the adapters are checkpointed and synced, resume is exact."""

import copy
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_run import overrides, read_records
from torch.distributed.checkpoint import FileSystemReader
from train_testing import prompt_response_batch

from klppo_train.checks.preflight import preflight
from klppo_train.checks.validate import validate_config
from klppo_train.config.errors import UserError
from klppo_train.config.schema import load_config
from klppo_train.demo.embedded import build_model
from klppo_train.runtime.lora import Lora, WithoutAdapters
from klppo_train.runtime.packed_attention import VARLEN
from klppo_train.workers.forward import response_logprobs
from rollout import BaseWeights, adapter_pairs, merged_weights

P, T, VOCAB = 6, 5, 64
QV = ("q_proj", "v_proj")


def _base():
    model = build_model(VOCAB, seed=0, hidden=64)
    model.set_attn_implementation(VARLEN)
    return model.eval()


def _logprobs(model) -> torch.Tensor:
    ids, mask = prompt_response_batch([6, 3, 4, 1], [5, 2, 4, 3], P, T, VOCAB)
    with torch.no_grad():
        return response_logprobs(model, ids, mask, T, max_tokens=64)[0] * mask[:, P:]


def _randomize_b(model, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


@pytest.mark.parametrize("targets", [("all-linear",), QV])
def test_zero_b_gives_exactly_the_base_log_probs(targets) -> None:
    base = _base()
    peft = Lora(8, 16.0, targets).apply(copy.deepcopy(base))
    trained = {n for n, p in peft.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert all(p.dtype == torch.float32 for p in peft.parameters() if p.requires_grad)
    assert torch.equal(_logprobs(peft), _logprobs(base))
    if targets == QV:
        assert {n.split(".")[-4] for n in trained} == set(QV)


def test_the_reference_is_the_base_model_with_adapters_off() -> None:
    base = _base()
    peft = Lora(8, 16.0, ("all-linear",)).apply(copy.deepcopy(base))
    _randomize_b(peft)
    reference = WithoutAdapters(peft)
    assert (_logprobs(peft) - _logprobs(base)).abs().max() > 1e-3  # the adapters act
    assert torch.equal(_logprobs(reference), _logprobs(_base()))  # a separately built base
    assert not list(reference.parameters())  # the actor's weights are not registered twice
    peft.train()
    reference.eval()
    assert peft.training  # nothing done to the reference reaches the actor


def test_a_critic_trains_adapters_and_its_value_head() -> None:
    from transformers import AutoModelForTokenClassification

    base = _base()
    config = copy.deepcopy(base.config)
    config.num_labels = 1
    critic = AutoModelForTokenClassification.from_config(config).to(torch.bfloat16)
    peft = Lora(4, 8.0, ("all-linear",), trained=("score",)).apply(critic)
    trained = {n: p for n, p in peft.named_parameters() if p.requires_grad}
    heads = {n for n in trained if "lora_" not in n}
    assert heads == {"base_model.model.score.weight", "base_model.model.score.bias"}
    assert all(p.dtype == torch.float32 for p in trained.values())
    frozen = [p for p in peft.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)


def test_a_first_forward_without_adapters_keeps_fp32_gradients() -> None:
    """FSDP2 in bf16, the reference's forward first (GRPO: no old-log-prob pass): FSDP2
    fixes each unit's gradient dtypes from requires_grad then, and peft's switch turns it
    off. The update after must reduce the fp32 adapters' gradients in fp32."""
    import torch.distributed as dist

    from fsdp_sharding import MixedPrecision, ShardingConfig, shard_model
    from klppo_train.runtime.process_group import init_distributed

    init_distributed()
    try:
        peft = Lora(4, 8.0, ("all-linear",)).apply(_base().to(torch.bfloat16))
        mixed = MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32")
        peft = shard_model(peft, ShardingConfig(mixed_precision=mixed))
        _logprobs(WithoutAdapters(peft))
        ids, mask = prompt_response_batch([6, 3], [5, 2], P, T, VOCAB)
        response_logprobs(peft, ids, mask, T, max_tokens=64)[0].sum().backward()
        grads = [p.grad for p in peft.parameters() if p.requires_grad]
        assert grads and all(g is not None and g.dtype == torch.float32 for g in grads)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("targets", [("all-linear",), QV])
def test_the_merge_equals_peft_merge_and_unload(tmp_path: Path, targets) -> None:
    base = _base()
    base.save_pretrained(tmp_path)
    lora = Lora(4, 8.0, targets)
    peft = lora.apply(copy.deepcopy(base))
    _randomize_b(peft)
    adapters = {n: p.detach() for n, p in peft.named_parameters() if p.requires_grad}
    pairs = adapter_pairs(adapters.items())
    merged = dict(merged_weights(pairs, BaseWeights(tmp_path), lora.scaling))  # α/r = 2
    want = peft.merge_and_unload().state_dict()
    assert set(merged) <= set(want) and len(merged) == len(
        load_file(tmp_path / "model.safetensors")
    )
    changed = 0
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, want[name], atol=1e-6, rtol=0)
        changed += not torch.equal(tensor, base.state_dict()[name])
    assert changed == len(adapters) // 2  # one weight per adapted layer


def _recipe(run: Path, *extra: str, engine: str = "hf", steps: int = 2) -> list[str]:
    return [*overrides(run, engine, steps), "model.lora_rank=8", "actor.lr=1e-3", *extra]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.lora_rank=-1", "model.lora_rank must be >= 0"),
        ("model.lora_alpha=0", "model.lora_alpha must be > 0"),
        ("model.target_modules=[]", "model.target_modules is empty"),
        ("actor.fsdp.strategy=fsdp1", "model.lora_rank needs actor.fsdp.strategy=fsdp2"),
    ],
)
def test_bad_lora_keys_are_refused(tmp_path: Path, override: str, message: str) -> None:
    cfg = load_config(overrides(tmp_path)[0], [*_recipe(tmp_path)[1:], override])
    with pytest.raises(ValueError, match=message):
        validate_config(cfg)


def test_verl_names_and_a_single_target_string(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.model.lora_rank=32",
            "actor_rollout_ref.model.lora_alpha=64",
            "actor_rollout_ref.model.target_modules=q_proj",
        ],
    )
    assert (cfg.model.lora_rank, cfg.model.lora_alpha) == (32, 64)
    assert cfg.model.target_modules == ("q_proj",)


def test_lora_needs_peft_and_the_ppo_task(tmp_path: Path, monkeypatch) -> None:
    cfg = load_config(None, ["model.lora_rank=8", "trainer.task=reward_model"])
    with pytest.raises(ValueError, match="trainer.task=reward_model trains the whole"):
        validate_config(cfg)
    # no reference model of its own to shard
    cfg = load_config(None, ["model.lora_rank=8", "ref.fsdp.forward_prefetch=true"])
    with pytest.raises(ValueError, match=r"ref.fsdp.\* takes no effect with model.lora_rank"):
        validate_config(cfg)
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "peft" else find_spec(name, *a),
    )
    with pytest.raises(ValueError, match=r"needs peft: pip install 'klppo-train\[lora\]'"):
        validate_config(load_config(None, ["model.lora_rank=8"]))


def test_an_unknown_target_module_fails_in_preflight(tmp_path: Path) -> None:
    model = tmp_path / "model"
    _base().save_pretrained(model)
    from klppo_train.data.datasets import write_parquet
    from klppo_train.demo.embedded import build_tokenizer
    from klppo_train.demo.tasks import COMPACT, make_arithmetic_rows

    build_tokenizer().save_pretrained(model)
    for name in ("train", "val"):
        rows = make_arithmetic_rows(8, seed=0, template=COMPACT)
        write_parquet(rows, tmp_path / "run" / "data" / f"{name}.parquet")
    args = [*_recipe(tmp_path / "run"), f"model.path={model}", "model.target_modules=[q_proj,qq]"]
    cfg = load_config(args[0], args[1:])
    with pytest.raises(UserError, match=r"model.target_modules=\['q_proj', 'qq'\]: .*qq"):
        preflight(cfg)
    critic = [*args[:-1], "critic.lora_rank=4", "critic.target_modules=up"]
    with pytest.raises(UserError, match=r"critic.target_modules=\['up'\]: 'up' names no linear"):
        preflight(load_config(critic[0], critic[1:]))


def _run_cli(args: list[str]) -> None:
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "klppo_train", *args], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.slow  # two short runs with vLLM (~1.5 min)
def test_a_lora_run_syncs_checkpoints_and_exports_only_adapters(tmp_path: Path) -> None:
    """3 steps with vLLM, q/v adapters on the actor, all-linear on the critic: the engine's
    log-probs are the trainer's after each sync while the policy moved away from the
    reference; the sync sent the adapters' bytes; the checkpoints hold the adapters only
    (and the critic's head); the exports (merged model, peft adapter) agree;
    step 2's checkpoint resumed gives step 3 bit-identical."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    straight = tmp_path / "straight"
    qv = "model.target_modules=[q_proj,v_proj]"
    critic = "critic.lora_rank=8"
    args = _recipe(straight, "trainer.save_freq=1", qv, critic, engine="vllm", steps=3)
    _run_cli(args)
    records = read_records(straight)
    adapter = load_file(straight / "actor_lora" / "adapter_model.safetensors")
    assert {k.split(".")[-3] for k in adapter} == {"q_proj", "v_proj"}
    adapter_bytes = sum(4 * t.numel() for t in adapter.values())  # fp32 on this CPU run
    for r in records[1:]:
        assert r["rollout/logprob_diff_max"] < 1e-5  # the engine runs the current adapter,
        assert r["rollout/weight_sync_bytes"] == adapter_bytes
    # ... which moved the policy: KL(π‖π_ref) ~ ½E[Δ²] puts the base's log-probs ~1e-2 away
    assert records[3]["actor/kl_loss"] > 1e-5
    for role, head in (("actor", ()), ("critic", ("score.weight", "score.bias"))):
        reader = FileSystemReader(straight / f"checkpoints/global_step_3/{role}")
        saved = [k for k in reader.read_metadata().state_dict_metadata if k.startswith("model.")]
        assert saved and all(".lora_" in k or k.endswith(head) for k in saved), role
    # the two exports are the same policy
    ids = torch.randint(3, 40, (2, 24))
    merged = AutoModelForCausalLM.from_pretrained(straight / "actor_hf", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(straight / "model", dtype=torch.float32)
    with torch.no_grad():
        want = PeftModel.from_pretrained(base, straight / "actor_lora")(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=0)
    # resume step 2's checkpoint
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("actor_*", "global_step_3"))
    lines = (resumed / "metrics.jsonl").read_text().splitlines()[:3]
    (resumed / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    _run_cli(_recipe(resumed, "trainer.save_freq=1", qv, critic, engine="vllm", steps=3))
    again = read_records(resumed)[3]
    keep = [k for k in again if not k.startswith(("timing_s/", "perf/"))]
    assert {k: again[k] for k in keep} == {k: records[3][k] for k in keep}
    assert json.loads((resumed / "summary.json").read_text())["steps"] == 3
