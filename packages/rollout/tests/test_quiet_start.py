"""An engine start prints no warning about Triton, which a CPU engine does not use."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a fresh interpreter: vLLM's import (~15 s) and one start (~10 s)

# In a fresh interpreter (torch sets its loggers up as it loads, as in a run): start an engine
# on a tiny model, and report whether vLLM registered its Triton op (what makes torch warn).
START = """
import sys
from rollout_testing import tiny_model
from rollout import VLLMConfig, VLLMEngine

tiny_model().save_pretrained(sys.argv[1])
engine = VLLMEngine(sys.argv[1], VLLMConfig(kv_cache_space_gib=0.25, max_model_len=128))
engine.close()
print("registered:", "vllm.kernels.triton.activation" in sys.modules)
"""


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
def test_an_engine_start_prints_no_triton_notice(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", START, str(tmp_path / "tiny")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # torch warns as vLLM registers the op, where Triton is missing: the filter's case
    assert "registered: True" in done.stdout, done.stdout
    assert "Triton not available" not in done.stderr, done.stderr[-4000:]
