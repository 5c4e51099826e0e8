"""scripts/plot_runs.py and the group means it draws: hand-made metrics.jsonl files."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from klppo_train.loop.report import group_means

ROOT = Path(__file__).resolve().parents[1]
ACC = "val/arithmetic_chat/acc"


def records(accs: dict[int, float], kl: float) -> list[dict]:
    """Validation at the given steps, a KL at every step 1..max."""
    out = []
    for step in range(max(accs) + 1):
        record = {"step": step} | ({ACC: accs[step]} if step in accs else {})
        out.append(record | ({"actor/reward_kl_penalty": kl * step} if step else {}))
    return out


RUNS = {
    "tis/s1": records({0: 0.3, 10: 0.5, 20: 0.7}, kl=0.1),
    "tis/s2": records({0: 0.3, 10: 0.4, 20: 0.6}, kl=0.2),
    "plain/s1": records({0: 0.3, 20: 0.5}, kl=0.3),  # no step-10 validation
}


def test_group_means_average_each_group_at_the_steps_all_its_runs_have() -> None:
    means = group_means(RUNS, ACC)
    assert means["tis"][0] == [0, 10, 20]
    assert means["tis"][1] == pytest.approx([0.3, 0.45, 0.65])
    assert means["plain"] == ([0, 20], [0.3, 0.5])
    uneven = group_means({"a/1": RUNS["tis/s1"], "a/2": RUNS["plain/s1"]}, ACC)
    assert uneven["a"][0] == [0, 20]  # step 10 is in one run only
    assert uneven["a"][1] == pytest.approx([0.3, 0.6])
    assert group_means(RUNS, "rollout_corr/rollout_is_max") == {}  # no run recorded it


def write_runs(tmp_path: Path) -> list[str]:
    specs = []
    for label, recs in RUNS.items():
        run = tmp_path / label.replace("/", "_")
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        specs.append(f"{label}={run}")
    return specs


def test_plot_runs_writes_the_png_and_prints_last_values_and_group_means(tmp_path: Path) -> None:
    out = tmp_path / "cmp.png"
    cmd = [sys.executable, str(ROOT / "scripts" / "plot_runs.py"), "--out", str(out)]
    panels = ["--panel", "val/*/acc=held-out accuracy", "--panel", "actor/reward_kl_penalty"]
    run = subprocess.run(
        cmd + panels + write_runs(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert not list(tmp_path.glob("*.tmp.png"))  # written atomically
    lines = run.stdout.splitlines()
    tis_acc = [line for line in lines if line.startswith("tis mean") and ACC in line]
    assert tis_acc and tis_acc[0].endswith("(2 runs)  0.6500")
    kl = [line for line in lines if line.startswith("plain/s1") and "kl_penalty" in line]
    assert kl and kl[0].endswith("step   20  6.0000")


def test_plot_runs_refuses_a_run_without_metrics_in_one_line(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "scripts" / "plot_runs.py"), "--out", str(tmp_path / "x.png")]
    run = subprocess.run(cmd + [f"tis/s1={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert len(run.stderr.strip().splitlines()) == 1 and "tis/s1" in run.stderr
    assert not (tmp_path / "x.png").exists()


def test_x_sqrt_kl_puts_each_validation_at_the_root_of_its_steps_kl(tmp_path: Path) -> None:
    """Gao et al.'s axis: √(per-token KL × mean response length) of the step; step 0 (no KL)
    is left out. tis/s1 at step 20: KL 0.1·20 = 2 per token × 8 tokens → x = 4."""
    for recs in RUNS.values():
        for r in recs:
            r["response_length/mean"] = 8.0
    out = tmp_path / "gao.png"
    cmd = [sys.executable, str(ROOT / "scripts" / "plot_runs.py"), "--out", str(out), "--x-sqrt-kl"]
    run = subprocess.run(
        cmd + ["--panel", f"{ACC}=gold"] + write_runs(tmp_path),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    last = [line for line in run.stdout.splitlines() if line.startswith("tis/s1") and ACC in line]
    assert last and last[0].endswith("step  4.0  0.7000")
