import sys
from pathlib import Path

# Shared helpers live next to the tests (pytest's importlib mode does not put this folder on
# sys.path).
sys.path.insert(0, str(Path(__file__).parent))

# What the command line registers before it checks a config: tests that call the checks,
# preflight or build directly use the demos' sources (SmolLM2, built-in data, embedded model).
from klppo_train.demo.sources import register_sources  # noqa: E402

register_sources()
