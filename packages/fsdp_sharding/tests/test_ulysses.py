"""Ulysses sequence parallelism's collectives (2 gloo ranks): attention split over the
sequence equals attention on the whole row, outputs and gradients."""

import json
from pathlib import Path

import pytest
import torch
from tiny_models import torchrun

from fsdp_sharding.ulysses import pad_to_multiple, repeat_kv_heads, sequence_slice


def test_padding_and_slices_cover_the_row_once() -> None:
    row = torch.arange(17)[None]
    padded, pad = pad_to_multiple(row, 4, value=-1)
    assert pad == 3 and padded.shape == (1, 20) and padded[0, -3:].tolist() == [-1] * 3
    parts = [sequence_slice(padded, 4, r) for r in range(4)]
    assert torch.equal(torch.cat(parts, dim=-1), padded)
    assert pad_to_multiple(row, 1)[1] == 0


def test_kv_heads_repeat_only_when_the_ranks_do_not_divide_them() -> None:
    kv = torch.randn(3, 2, 4)
    assert repeat_kv_heads(kv, 2) is kv
    repeated = repeat_kv_heads(kv, 4)
    assert repeated.shape == (3, 4, 4) and torch.equal(repeated[:, 1], kv[:, 0])
    with pytest.raises(ValueError, match="cannot be shared"):
        repeat_kv_heads(torch.randn(3, 3, 4), 2)


@pytest.mark.slow  # two processes
def test_split_attention_equals_the_whole_row(tmp_path: Path) -> None:
    out = tmp_path / "ulysses.json"
    torchrun("ulysses_worker.py", str(out))
    ranks = json.loads(out.read_text())
    for rank in ranks:
        assert set(rank) == {"4x4", "4x2", "4x1"}  # MHA, GQA, KV heads repeated for 2 ranks
        for shape, diffs in rank.items():
            assert all(d < 1e-5 for d in diffs.values()), (shape, diffs)
