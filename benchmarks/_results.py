"""Shared by the benchmarks (each run as ``python benchmarks/<name>.py``, so this folder is on
``sys.path``): where results go and how they are written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def write_results(data: Any, out: Path) -> None:
    """Write ``data`` as JSON to ``out`` atomically (never a half-written result) and say so."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(out)
    print(f"wrote {out}")
