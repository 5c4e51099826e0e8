"""FSDP2 and FSDP1 on 2 gloo ranks train exactly like one unsharded process, for every lever."""

import json

import pytest
from tiny_models import torchrun

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("parity") / "parity.json"
    torchrun("parity_worker.py", str(out))
    return json.loads(out.read_text())


def test_every_variant_ran(parity) -> None:
    # 9 FSDP2 + 7 FSDP1 variants (no offload_policy / prefetch depth on FSDP1), 2 models
    assert len(parity) == 32


def test_losses_and_parameters_match_unsharded(parity) -> None:
    for key, r in parity.items():
        assert r["loss_diff"] <= 1e-5, (key, r["losses"])
        assert r["param_diff"] <= 5e-5, key  # AdamW at lr 1e-2 amplifies 1e-7 gradient noise
        assert r["norm_diff"] <= 1e-5, key  # clip_grad_norm sees the global norm
        assert r["names_match"] and r["init_stream_exact"], key


def test_prefetch_lists_are_set(parity) -> None:
    # Qwen2 untied: units = embed_tokens, 2 layers, lm_head; [forward, backward] list lengths
    assert parity["qwen2_untied/fsdp2/default"]["prefetch"] == [[0, 0], [0, 1], [0, 1], [0, 1]]
    assert parity["qwen2_untied/fsdp2/forward_prefetch"]["prefetch"] == [
        [1, 0],
        [1, 1],
        [1, 1],
        [0, 1],
    ]
    assert parity["qwen2_untied/fsdp2/forward_prefetch_depth2"]["prefetch"] == [
        [2, 0],
        [2, 1],
        [1, 1],
        [0, 1],
    ]
    assert parity["qwen2_untied/fsdp2/no_backward_prefetch"]["prefetch"] == [[0, 0]] * 4
    # Llama with tied embeddings: the embedding stays in the root, units = the 2 layers
    assert parity["llama_tied/fsdp2/forward_prefetch"]["prefetch"] == [[1, 0], [0, 1]]


def test_levers_are_applied(parity) -> None:
    for model in ("qwen2_untied", "llama_tied"):
        for strategy in ("fsdp2", "fsdp1"):
            assert (
                parity[f"{model}/{strategy}/gradient_checkpointing"]["applied"][
                    "checkpoint_wrappers"
                ]
                == 2
            )
            assert parity[f"{model}/{strategy}/default"]["applied"]["checkpoint_wrappers"] == 0
        keeps = parity[f"{model}/fsdp2/reshard_off"]["applied"]["keeps_params_after_forward"]
        assert all(keeps)
        default = parity[f"{model}/fsdp2/default"]["applied"]["keeps_params_after_forward"]
        assert default[-1] and not any(default[:-1])  # only the last unit keeps its params
        assert parity[f"{model}/fsdp1/reshard_off"]["applied"]["strategy"].endswith("SHARD_GRAD_OP")
