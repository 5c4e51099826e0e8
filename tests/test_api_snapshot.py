"""A distribution's public API changes only together with its version.

Each distribution has a checked-in snapshot, ``tests/api/<distribution>.json`` (written by
``scripts/api_snapshot.py``): its version and, per public name, the kind and signature. The
test fails when the API differs from the snapshot of the same version (bump the version), and
when the version moved but the snapshot did not (regenerate it): a bump and its snapshot go
together. The CHANGELOG's newest release must be the version, and the internal dependency
pins must follow the workspace's policy (``>=X.Y,<1``, admitting the workspace's version).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("api_snapshot", ROOT / "scripts/api_snapshot.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("api_snapshot", module)
    spec.loader.exec_module(module)
    return module


snap = _load_script()
DISTS = sorted(snap.DISTRIBUTIONS)


def _pyproject_path(dist: str) -> str:
    return f"{snap.DISTRIBUTIONS[dist][0]}/pyproject.toml"


@pytest.mark.parametrize("dist", DISTS)
def test_api_matches_the_snapshot_of_its_version(dist: str) -> None:
    path = snap.snapshot_path(dist)
    regenerate = f"regenerate with `{snap.REGENERATE}`"
    assert path.exists(), f"{dist}: no API snapshot {path.relative_to(ROOT)}; {regenerate}"
    recorded = json.loads(path.read_text())
    now = snap.current(dist)
    changes = snap.differences(recorded["api"], now["api"])
    listed = "".join(f"\n  {line}" for line in changes)
    pyproject = _pyproject_path(dist)
    version, old = now["version"], recorded["version"]
    if version != old:
        direction = "went back" if Version(version) < Version(old) else "was bumped"
        pytest.fail(
            f"{dist}: the version in {pyproject} {direction} ({old} -> {version}) but "
            f"{path.relative_to(ROOT)} still records {old}: {regenerate} (a bump and its "
            f"snapshot go together)." + (f"\nAPI changes since {old}:{listed}" if changes else ""),
            pytrace=False,
        )
    if changes:
        pytest.fail(
            f"{dist} {version}: the public API differs from {path.relative_to(ROOT)}, "
            f"recorded for this same version:{listed}\n"
            f"bump the version in {pyproject} and regenerate with `{snap.REGENERATE}` "
            f"(and add the change to {Path(pyproject).parent}/CHANGELOG.md; docs/releasing.md).",
            pytrace=False,
        )


@pytest.mark.parametrize("dist", DISTS)
def test_changelog_names_the_version(dist: str) -> None:
    folder = ROOT / snap.DISTRIBUTIONS[dist][0]
    changelog = folder / "CHANGELOG.md"
    assert changelog.exists(), f"{dist}: no {changelog.relative_to(ROOT)}"
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", changelog.read_text(), flags=re.M)
    version = snap.version_of(dist)
    assert releases and releases[0] == version, (
        f"{changelog.relative_to(ROOT)}: newest release {releases[:1]}, but "
        f"{_pyproject_path(dist)} says {version}: add a '## [{version}] - YYYY-MM-DD' section"
    )
    assert releases == sorted(releases, key=Version, reverse=True), (
        f"{changelog.relative_to(ROOT)}: releases not newest first: {releases}"
    )


def test_internal_pins_admit_the_workspace_and_stop_before_1() -> None:
    versions = {dist: Version(snap.version_of(dist)) for dist in DISTS}
    seen = 0
    for dist in DISTS:
        for text in snap.pyproject(dist)["project"].get("dependencies", []):
            req = Requirement(text)
            if req.name not in versions:
                continue
            seen += 1
            where = f"{_pyproject_path(dist)}: {text!r}"
            bounds = sorted((s.operator, Version(s.version)) for s in req.specifier)
            assert [op for op, _ in bounds] == ["<", ">="], f"{where}: not >=X.Y,<1"
            assert bounds[0][1] == Version("1"), f"{where}: the upper bound is <1"
            assert versions[req.name] in req.specifier, (
                f"{where} excludes the workspace's {req.name} {versions[req.name]}"
            )
    assert seen, "no internal dependency found (klppo-train depends on every package)"
