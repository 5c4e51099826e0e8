import sys
from pathlib import Path

import pytest

# Helpers live next to the tests (pytest's importlib mode does not put this folder on sys.path).
sys.path.insert(0, str(Path(__file__).parent))

from rollout_testing import tiny_model  # noqa: E402


@pytest.fixture
def model():
    return tiny_model()
