"""Every package README shows its use in code that runs: each ```python block after a
``<!-- run: tests/test_readmes.py -->`` line runs here, in a fresh interpreter; and the
examples in ``examples/`` run and do what they say."""

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- run: tests/test_readmes.py -->"
READMES = sorted(ROOT.glob("packages/*/README.md"))


def runnable_blocks(readme: Path) -> list[str]:
    pattern = re.escape(MARK) + r"\s*```python\n(.*?)```"
    return re.findall(pattern, readme.read_text(), flags=re.S)


@pytest.mark.parametrize("readme", READMES, ids=lambda p: p.parent.name)
def test_every_package_readme_runs_its_example(readme: Path, tmp_path: Path) -> None:
    blocks = runnable_blocks(readme)
    assert blocks, f"{readme}: no ```python block marked {MARK}"
    for block in blocks:
        done = subprocess.run(
            [sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, f"{readme}:\n{block}\n{done.stderr[-3000:]}"


def test_ppo_core_readme_is_a_guide() -> None:
    text = (ROOT / "packages/ppo_core/README.md").read_text()
    assert len(text.splitlines()) >= 20


def test_plain_torch_example_learns() -> None:
    """ppo_core and batching in a loop that is not klppo's: the reward rises (from ~1/32)."""
    example = runpy.run_path(str(ROOT / "examples/ppo_core_plain_torch.py"))
    rewards = example["main"](["--steps", "12"])
    assert len(rewards) == 12
    assert sum(rewards[-3:]) / 3 > 4 * max(sum(rewards[:3]) / 3, 0.02)
