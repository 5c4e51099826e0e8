"""Checkpoint manifests: every file of a checkpoint directory with its size and CRC-32,
written last, so a checkpoint damaged after it was published (a truncated copy, a full
shared disk, a flipped bit) is recognised before anything loads from it.

Publishing by rename (:func:`fsdp_sharding.save_checkpoint`) guards against a crash during
the save; the manifest guards against what happens to the files afterwards.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from pathlib import Path

log = logging.getLogger("fsdp_sharding")
MANIFEST = "manifest.json"
_CHUNK = 1 << 20


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(path: str | Path) -> Path:
    """Record every file under ``path`` (relative name, size, CRC-32) in
    ``path/manifest.json``, written atomically and last. Call it once the directory is
    complete, from one process."""
    path = Path(path)
    files = {
        f.relative_to(path).as_posix(): {"size": f.stat().st_size, "crc32": _crc32(f)}
        for f in sorted(path.rglob("*"))
        if f.is_file() and f.name != MANIFEST
    }
    tmp = path / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"version": 1, "files": files}, indent=1))
    os.replace(tmp, path / MANIFEST)
    return path / MANIFEST


def verify_manifest(path: str | Path) -> str | None:
    """None when every file ``path/manifest.json`` lists is there with its size and
    checksum; else the first problem, naming the file. A directory without a manifest
    (written before manifests existed) is reported as such, not as damaged: the caller
    decides (``has_manifest``)."""
    path = Path(path)
    manifest = path / MANIFEST
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{manifest} is unreadable ({type(err).__name__})"
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{f} has {size} bytes, its manifest says {want['size']}"
        if _crc32(f) != want["crc32"]:
            return f"{f} fails its CRC-32 check"
    return None


def has_manifest(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).exists()
