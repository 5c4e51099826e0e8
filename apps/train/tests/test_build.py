"""What ``build_components`` makes of ``model.dtype``, ``model.gradient_checkpointing`` and
the KL switches: real sharded models (1-rank gloo group), HF engine, tiny embedded model."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from train_testing import prompt_response_batch

from klppo_train.config.schema import load_config
from klppo_train.data.datasets import write_parquet
from klppo_train.data.rewards import RewardManager
from klppo_train.demo.embedded import build_model, build_tokenizer
from klppo_train.demo.tasks import make_arithmetic_rows
from klppo_train.runtime.hf_dirs import save_atomically
from klppo_train.runtime.packed_attention import GROUP_ATTENTION
from klppo_train.runtime.precision import choose_cpu_dtype, resolve_precision
from klppo_train.runtime.process_group import init_distributed
from klppo_train.trainer.build import build_components
from klppo_train.workers.forward import response_logprobs, response_values

P, T = 24, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("build")
    tokenizer = build_tokenizer()
    save_atomically(build_model(len(tokenizer), seed=0, hidden=64), tokenizer, root / "model")
    write_parquet(make_arithmetic_rows(8, seed=0), root / "rows.parquet")
    return root


@pytest.fixture
def process_group():
    init_distributed()
    yield
    dist.destroy_process_group()


def build(root, *overrides):
    cfg = load_config(
        None,
        [
            f"model.path={root / 'model'}",
            f"data.train_files=[{root / 'rows.parquet'}]",
            f"data.val_files=[{root / 'rows.parquet'}]",
            "data.max_prompt_length=64",
            "rollout.engine=hf",
            "algorithm.use_kl_in_reward=true",
            *overrides,
        ],
    )
    return build_components(cfg, root / "model", build_tokenizer(), RewardManager())


def weight_dtypes_in_forward(model) -> set[torch.dtype]:
    """dtypes of the weights every nn.Linear multiplies with during one packed forward."""
    seen: set[torch.dtype] = set()
    hooks = [
        m.register_forward_pre_hook(lambda mod, args: seen.add(mod.weight.dtype))
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    ids, mask = prompt_response_batch([5, 3], [4, 2], P, T, vocab=90)
    with torch.no_grad():
        response_logprobs(model, ids, mask, T, max_tokens=1000)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.usefixtures("process_group")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_dtype_is_the_compute_dtype_of_every_role(model_dir, dtype) -> None:
    c = build(model_dir, f"model.dtype={str(dtype).removeprefix('torch.')}")
    # master weights (what AdamW steps) stay fp32; the frozen reference is stored in dtype
    for optimizer in (c.actor.optimizer, c.critic.optimizer):
        assert {p.dtype for g in optimizer.param_groups for p in g["params"]} == {torch.float32}
    assert {p.dtype for p in c.ref.model.parameters()} == {dtype}
    assert weight_dtypes_in_forward(c.actor.model) == {dtype}
    assert weight_dtypes_in_forward(c.ref.model) == {dtype}
    assert {p.dtype for p in c.engine.model.parameters()} == {dtype}
    assert c.weight_sync.dtype == dtype


@pytest.mark.usefixtures("process_group")
def test_role_param_dtype_overrides_model_dtype(model_dir) -> None:
    c = build(model_dir, "model.dtype=bfloat16", "actor.fsdp.param_dtype=float32")
    assert weight_dtypes_in_forward(c.actor.model) == {torch.float32}
    assert weight_dtypes_in_forward(c.ref.model) == {torch.bfloat16}


def layer_forward_calls(model, run) -> int:
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    calls = [0]
    hooks = [
        m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for m in layers
    ]
    run()
    for h in hooks:
        h.remove()
    return calls[0] // len(layers)


@pytest.mark.usefixtures("process_group")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_gradient_checkpointing_recomputes_in_backward(model_dir, checkpointing) -> None:
    c = build(model_dir, f"model.gradient_checkpointing={str(checkpointing).lower()}")
    ids, mask = prompt_response_batch([5, 3], [4, 2], P, T, vocab=90)
    runs = {
        "actor": lambda: response_logprobs(c.actor.model, ids, mask, T, max_tokens=1000)[0],
        "critic": lambda: response_values(c.critic.model, ids, mask, T, max_tokens=1000),
    }
    for role, forward in runs.items():
        model = getattr(c, role).model
        # each decoder layer runs once in forward, and once more in backward when checkpointed
        calls = layer_forward_calls(model, lambda f=forward: f().sum().backward())
        assert calls == (2 if checkpointing else 1), role


@pytest.mark.usefixtures("process_group")
def test_no_reference_model_without_a_kl_path(model_dir) -> None:
    assert build(model_dir, "algorithm.use_kl_in_reward=false").ref is None
    assert build(model_dir, "algorithm.use_kl_in_reward=false", "actor.use_kl_loss=true").ref.model


def test_auto_attention_on_a_flash_attn_gpu_follows_share_prompts_and_ulysses(
    monkeypatch,
) -> None:
    # flash-attn's varlen kernel cannot attend over a shared prompt prefix, nor exchange the
    # heads of a row split by Ulysses: with either, auto takes klppo_varlen on a GPU too.
    import importlib.util

    from klppo_train.trainer.build import attention_implementation

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    cuda = torch.device("cuda")
    unshared = ["model.share_prompts=false"]
    cases = {
        (*unshared,): "flash_attention_2",
        (): "klppo_varlen",
        (*unshared, "actor.ulysses_sequence_parallel_size=2"): "klppo_varlen",
        (*unshared, "model.attn_implementation=sdpa"): "sdpa",
    }
    for overrides, expected in cases.items():
        assert attention_implementation(load_config(None, list(overrides)), cuda) == expected


def test_auto_dtype_follows_the_matmul_probe() -> None:
    # An AVX512-BF16/AMX CPU (numbers from our notes) and an AVX2-only one (bf16 ~4x slower).
    fast = choose_cpu_dtype(fp32_gflops=215.0, bf16_gflops=950.0)
    slow = choose_cpu_dtype(fp32_gflops=210.0, bf16_gflops=50.0)
    assert fast.dtype == torch.bfloat16 and "950" in fast.reason and "4.42x" in fast.reason
    assert slow.dtype == torch.float32 and "no fast bf16" in slow.reason


def test_auto_dtype_probes_this_machine(caplog) -> None:
    with caplog.at_level("INFO", logger="klppo_train"):
        choice = resolve_precision("auto", torch.device("cpu"))
    assert choice.dtype in (torch.float32, torch.bfloat16)
    assert "GFLOP/s" in caplog.text and choice.name in caplog.text
    assert resolve_precision("bfloat16", torch.device("cpu")).dtype == torch.bfloat16
    assert resolve_precision("auto", torch.device("cuda")).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="model.dtype"):
        resolve_precision("float16", torch.device("cpu"))


@pytest.mark.usefixtures("process_group")
@pytest.mark.parametrize(("setting", "runs"), [("auto", "klppo_varlen"), ("sdpa", "sdpa")])
def test_attn_implementation_picks_the_attention_that_runs(model_dir, setting, runs) -> None:
    share = "true" if setting == "auto" else "false"  # sdpa cannot attend over shared prompts
    c = build(model_dir, f"model.attn_implementation={setting}", f"model.share_prompts={share}")
    for model in (c.actor.model, c.critic.model, c.ref.model):
        assert model.config._attn_implementation == runs


@pytest.mark.usefixtures("process_group")
def test_model_compile_compiles_the_blocks_and_keeps_the_numbers(model_dir) -> None:
    eager = build(model_dir, "model.dtype=float32")
    compiled = build(model_dir, "model.dtype=float32", "model.compile=true")
    for c, want in ((eager, False), (compiled, True)):
        blocks = [
            m for m in c.actor.model.modules() if type(m).__name__.endswith(("MLP", "RMSNorm"))
        ]
        assert blocks and {m._compiled_call_impl is not None for m in blocks} == {want}
        layers = [m for m in c.actor.model.modules() if type(m).__name__.endswith("Attention")]
        assert layers and {hasattr(m, GROUP_ATTENTION) for m in layers} == {want}
    ids, mask = prompt_response_batch([5, 3], [4, 2], P, T, vocab=90)
    valid = mask[:, P:].bool()
    got, _ = response_logprobs(compiled.actor.model, ids, mask, T, max_tokens=1000)
    want, _ = response_logprobs(eager.actor.model, ids, mask, T, max_tokens=1000)
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=0)
    got.sum().backward()  # the compiled backward runs too
    assert all(p.grad is not None for p in compiled.actor.model.parameters())


@pytest.mark.usefixtures("process_group")
def test_sharded_critic_forward_gives_fsdp2_no_view_warning(model_dir) -> None:
    c = build(model_dir)
    ids, mask = prompt_response_batch([5, 3], [4, 2], P, T, vocab=90)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        response_values(c.critic.model, ids, mask, T, max_tokens=1000).sum().backward()
    assert not [w for w in caught if "view tensor" in str(w.message)]


@pytest.mark.usefixtures("process_group")
@pytest.mark.parametrize(
    ("setting", "units"),
    [
        ([], {"Qwen2DecoderLayer"}),  # the model's own _no_split_modules
        (["critic.fsdp.wrap_policy=[Qwen2MLP]"], {"Qwen2MLP"}),
        # by size, bottom-up: each MLP (~25k parameters), then the model body with the rest
        (["critic.fsdp.min_num_params=20000"], {"Qwen2MLP", "Qwen2Model"}),
    ],
)
def test_wrap_policy_and_min_num_params_choose_the_shard_units(model_dir, setting, units) -> None:
    from torch.distributed.fsdp import FSDPModule

    c = build(model_dir, *setting)
    root = type(c.critic.model).__name__.removeprefix("FSDP")
    found = {
        type(m).__name__.removeprefix("FSDP")
        for m in c.critic.model.modules()
        if isinstance(m, FSDPModule)
    } - {root}
    assert found == units
