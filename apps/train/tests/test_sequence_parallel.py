"""Ulysses sequence parallelism in the trainer's forwards (issue 30): 2 gloo ranks splitting
each packed row give the log-probs, entropies, values, scores and gradients of the whole row."""

import pytest
import torch
from test_data_parallel import _torchrun
from test_preflight import _exit_2_matching, _tiny_model_dir, run  # noqa: F401 (a fixture)
from train_testing import prompt_response_batch

from batching import pack
from klppo_train.checks.validate import validate_config
from klppo_train.config.schema import load_config
from klppo_train.runtime.sequence_parallel import SequenceParallel, SequenceShard

SP2 = ["actor.ulysses_sequence_parallel_size=2", "model.share_prompts=false"]


@pytest.mark.parametrize(
    ("overrides", "world", "match"),
    [
        (["actor.ulysses_sequence_parallel_size=0"], 2, "must be >= 1 and divide the world"),
        (SP2, 3, "actor.ulysses_sequence_parallel_size=2 must be >= 1 and divide the world"),
        ([*SP2, "critic.ulysses_sequence_parallel_size=1"], 2, "critic.ulysses.*differs from"),
        ([*SP2, "ref.ulysses_sequence_parallel_size=4"], 4, "ref.ulysses.*differs from"),
        (
            [SP2[0], "model.share_prompts=true"],
            2,
            "model.share_prompts=true with actor.ulysses_sequence_parallel_size=2",
        ),
        ([*SP2, "model.attn_implementation=sdpa"], 2, "needs model.attn_implementation"),
        # the data split over world / sp ranks: 2 prompts over 2 groups of 2 here
        ([*SP2, "data.train_batch_size=3"], 4, "3 prompts do not split evenly over 2 ranks"),
    ],
)
def test_sequence_parallel_config_errors_name_the_key(overrides, world, match) -> None:
    base = [
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2",
        "critic.ppo_mini_batch_size=2",
    ]
    with pytest.raises(ValueError, match=match):
        validate_config(load_config(None, [*base, *overrides]), world_size=world)


def test_verl_names_of_the_size_are_accepted() -> None:
    for key in (
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size",
    ):
        assert load_config(None, [f"{key}=2"]).actor.ulysses_sequence_parallel_size == 2
    ref = "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size=2"
    assert load_config(None, [ref]).ref.ulysses_sequence_parallel_size == 2
    critic = "critic.model.fsdp_config.ulysses_sequence_parallel_size=2"
    assert load_config(None, [critic]).critic.ulysses_sequence_parallel_size == 2
    validate_config(load_config(None, SP2), world_size=2)  # the embedded default splits


def test_heads_that_do_not_split_exit_2_before_any_model(
    run,  # noqa: F811 (the fixture)
    capsys,
    tmp_path,
    monkeypatch,
) -> None:
    model = _tiny_model_dir(tmp_path / "model")  # hidden 64: 2 heads, 1 key/value head
    capsys.readouterr()  # its save's progress bar
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun --nproc-per-node=4 sets it
    sp4 = ["actor.ulysses_sequence_parallel_size=4", "model.share_prompts=false"]
    pattern = r"actor.ulysses_sequence_parallel_size=4: model.path's model has 2 attention heads"
    _exit_2_matching(run, capsys, [f"model.path={model}", *sp4], pattern)


def test_the_zigzag_slices_of_a_padded_row_cover_it_once() -> None:
    ids, mask = prompt_response_batch([3, 2], [2, 0], 4, 3, 64)  # 7 tokens
    packing = pack(ids, mask)
    shards = [SequenceShard(packing, SequenceParallel(2, r)) for r in range(2)]
    kwargs = [s.model_kwargs() for s in shards]
    # padded to 16 = 4 rounds of 2·2 chunks of 1: rank r holds chunks r and 3 - r of each
    mine = [[0, 3, 4, 7, 8, 11, 12, 15], [1, 2, 5, 6, 9, 10, 13, 14]]
    assert shards[0].order.tolist() == mine[0] + mine[1]
    row = torch.cat([k["input_ids"] for k in kwargs], dim=1)[0, torch.argsort(shards[0].order)]
    assert row.shape == (16,) and torch.equal(row[:7], packing.input_ids[0])
    positions = [k["position_ids"][0].tolist() for k in kwargs]
    assert positions == [[0, 3, 4, 0, 1, 4, 5, 8], [1, 2, 0, 1, 2, 3, 6, 7]]  # padding: 0..8
    assert kwargs[0]["cu_seq_lens_q"].tolist() == [0, 5, 7, 16]
    keep = torch.tensor([1, 2, 3, 6])
    split = [s.split(keep) for s in shards]
    assert [m.tolist() for m, _ in split] == [[3], [1, 2, 6]]
    assert [loc.tolist() for _, loc in split] == [[1], [0, 1, 3]]


@pytest.mark.slow  # two processes
def test_split_rows_give_the_whole_rows_outputs_and_gradients(tmp_path) -> None:
    ranks = _torchrun("sp_forward_worker.py", tmp_path)
    for rank in ranks:
        assert set(rank) == {"128", "128_fsdp", "64", "64_fsdp"}
        for case, diffs in rank.items():
            # each rank ran half a row; these rows are short (<= 40 tokens), so the padding
            # to a multiple of 16 (8 · sp: the zigzag's chunks) is a large part of them
            share = diffs.pop("tokens_share")
            assert 0.5 <= share <= 0.75, (case, share)
            assert len(diffs) == 7 and all(d < 1e-6 for d in diffs.values()), (case, diffs)
