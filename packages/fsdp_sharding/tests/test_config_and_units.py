"""ShardingConfig validation and shard-unit selection (single process, real HF models)."""

import logging

import pytest
import torch
from tiny_models import tiny_llama, tiny_qwen2
from torch import nn

from fsdp_sharding import ShardingConfig, choose_shard_units
from fsdp_sharding.activations import ActivationOffload, GradientCheckpointing, clean_name
from fsdp_sharding.config import CPU_DEFAULT_PRECISION, GPU_DEFAULT_PRECISION, MixedPrecision
from fsdp_sharding.fsdp2 import reshard_policy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"strategy": "ddp"}, "strategy"),
        ({"reshard_after_forward": 0}, "reshard_after_forward"),
        ({"reshard_after_forward": 2, "strategy": "fsdp1"}, "reshard_after_forward"),
        ({"offload_policy": True, "strategy": "fsdp1"}, "offload_policy"),
        ({"forward_prefetch": 0}, "forward_prefetch"),
        ({"fsdp_size": 0}, "fsdp_size"),
        ({"min_num_params": 0}, "min_num_params"),
        ({"min_num_params": 10, "wrap_policy": ("X",)}, "wrap_policy"),
        ({"gradient_checkpointing": True, "activation_offload": True}, "activation_offload"),
    ],
)
def test_bad_config_names_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=f"ShardingConfig.{field}"):
        ShardingConfig(**kwargs)


def test_precision_defaults_per_device() -> None:
    config = ShardingConfig()
    assert config.precision_for(torch.device("cpu")) == CPU_DEFAULT_PRECISION
    assert config.precision_for(torch.device("cuda")) == GPU_DEFAULT_PRECISION
    custom = MixedPrecision(param_dtype=torch.float16, reduce_dtype="fp32")
    assert ShardingConfig(mixed_precision=custom).precision_for(torch.device("cuda")) == custom


def test_mixed_precision_takes_names_short_names_and_dtypes() -> None:
    by_name = MixedPrecision(param_dtype="bf16", reduce_dtype="float32")
    assert by_name == MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert by_name.param_dtype == "bfloat16"  # stored by canonical name (plain YAML)
    assert (by_name.param, by_name.reduce, by_name.buffer) == (torch.bfloat16, torch.float32, None)
    with pytest.raises(ValueError, match="MixedPrecision.buffer_dtype='int8'"):
        MixedPrecision(buffer_dtype="int8")


def test_units_default_to_no_split_modules_with_untied_embeddings() -> None:
    model = tiny_qwen2(tie=False)
    units = choose_shard_units(model, ShardingConfig())
    names = [type(u).__name__ for u in units]
    assert names == ["Embedding", "Qwen2DecoderLayer", "Qwen2DecoderLayer", "Linear"]
    assert units[0] is model.model.embed_tokens and units[-1] is model.lm_head


def test_tied_embeddings_stay_with_the_root() -> None:
    units = choose_shard_units(tiny_llama(), ShardingConfig())
    assert [type(u).__name__ for u in units] == ["LlamaDecoderLayer"] * 2


def test_wrap_policy_without_a_match_lists_what_the_model_has() -> None:
    with pytest.raises(ValueError, match=r"looked for \['GPT2Block'\].*'Qwen2DecoderLayer'"):
        choose_shard_units(tiny_qwen2(), ShardingConfig(wrap_policy=("GPT2Block",)))


def test_size_based_policy() -> None:
    model = tiny_qwen2(tie=False)
    # each decoder layer holds ~41k parameters, each embedding 8192
    units = choose_shard_units(model, ShardingConfig(min_num_params=30_000))
    assert [type(u).__name__ for u in units] == ["Qwen2DecoderLayer"] * 2
    with pytest.raises(ValueError, match="matched no module"):
        choose_shard_units(model, ShardingConfig(min_num_params=10**9))
    # more than one layer's worth: the layers' ModuleList would qualify, but a container
    # without its own forward cannot be a unit (fully_shard refuses it); its parameters move
    # up to the model body instead
    units = choose_shard_units(model, ShardingConfig(min_num_params=60_000))
    assert [type(u).__name__ for u in units] == ["Qwen2Model"]


def test_reshard_policy_keeps_the_last_unit() -> None:
    config = ShardingConfig()
    assert [reshard_policy(config, i, 3) for i in range(3)] == [True, True, False]
    assert reshard_policy(ShardingConfig(reshard_after_forward=2), 2, 3) == 2


def test_checkpointing_wraps_blocks_and_names_stay_hf() -> None:
    model = tiny_qwen2(tie=False)
    names = [n for n, _ in model.named_parameters()]
    units = GradientCheckpointing().apply(model, choose_shard_units(model, ShardingConfig()))
    assert [type(u).__name__ for u in units] == [
        "Embedding",
        "CheckpointWrapper",
        "CheckpointWrapper",
        "Linear",
    ]
    wrapped = [n for n, _ in model.named_parameters()]
    assert wrapped != names and [clean_name(n) for n in wrapped] == names
    rows = torch.randint(0, 128, (2, 8))
    loss = model(input_ids=rows, labels=rows).loss
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_activation_offload_keeps_results_identical() -> None:
    rows = torch.randint(0, 128, (2, 8))
    plain, hooked = tiny_qwen2(), tiny_qwen2()
    ActivationOffload().apply(hooked, choose_shard_units(hooked, ShardingConfig()))
    for model in (plain, hooked):
        model(input_ids=rows, labels=rows).loss.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), hooked.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_tiny_models_are_what_the_tests_assume() -> None:
    model = tiny_qwen2(tie=False)
    assert isinstance(model.lm_head, nn.Linear)
    assert model.get_input_embeddings().weight is not model.get_output_embeddings().weight
    logging.getLogger("fsdp_sharding").debug("ok")
