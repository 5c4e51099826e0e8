"""Checkpoint manifests: an intact directory verifies; a truncated, bit-flipped or missing
file, or an unreadable manifest, is named."""

from pathlib import Path

import pytest

from fsdp_sharding import has_manifest, verify_manifest, write_manifest


def _checkpoint(d: Path) -> Path:
    (d / "actor").mkdir(parents=True)
    (d / "actor" / "__0_0.distcp").write_bytes(bytes(range(256)) * 5000)  # > one 1 MiB chunk
    (d / "actor" / "extra_state.pt").write_bytes(b"step 3")
    (d / "critic").mkdir()
    (d / "critic" / ".metadata").write_bytes(b"meta")
    return d


def test_an_intact_checkpoint_verifies(tmp_path: Path) -> None:
    d = _checkpoint(tmp_path / "global_step_3")
    assert not has_manifest(d)
    write_manifest(d)
    assert has_manifest(d) and verify_manifest(d) is None


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[:-10])


def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[700_000] ^= 0x01  # one bit, in the second chunk
    f.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (_truncate, "has 1279990 bytes, its manifest says 1280000"),
        (_flip, "fails its CRC-32 check"),
        (Path.unlink, "is missing"),
    ],
    ids=["truncated", "bit flipped", "deleted"],
)
def test_a_damaged_file_is_named(tmp_path: Path, damage, says) -> None:
    d = _checkpoint(tmp_path / "global_step_3")
    write_manifest(d)
    damage(d / "actor" / "__0_0.distcp")
    problem = verify_manifest(d)
    assert problem is not None and "__0_0.distcp" in problem and says in problem


def test_an_unreadable_manifest_is_reported(tmp_path: Path) -> None:
    d = _checkpoint(tmp_path / "global_step_3")
    write_manifest(d)
    (d / "manifest.json").write_text('{"files": ')
    assert "manifest.json is unreadable" in verify_manifest(d)
