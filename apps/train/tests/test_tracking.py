"""trainer.logger: each tracker holds what metrics.jsonl holds, read back with the tracker's
own reader (TensorBoard's EventAccumulator, wandb's offline run file, MLflow's client); a
resumed run continues the same tracker run; log_val_generations; a missing extra is
refused before any model loads."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from test_run import overrides, read_records

from klppo_train.__main__ import main
from klppo_train.checks.validate import validate_config
from klppo_train.config.schema import load_config

LOGGERS = "trainer.logger=[console,file,tensorboard,wandb,mlflow]"


def tensorboard_values(run: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def wandb_records(path: Path):
    """The records of a wandb run file. wandb >= 0.31 ships no Python reader for them (its
    Go core reads them): the framing is LevelDB's log format (32 KiB blocks, 7-byte record
    headers: crc, length, type FULL/FIRST/MIDDLE/LAST) after wandb's 7-byte file header;
    each record is decoded with wandb's own protobuf class."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00", "not a wandb run file (version 0)"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_values(run: Path) -> tuple[set[tuple], dict[str, dict[int, float]]]:
    """The runs (id, project, name) and the history of the offline wandb run files under the
    run dir."""
    runs, values = set(), {}
    for path in sorted((run / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "run":
                runs.add((record.run.run_id, record.run.project, record.run.display_name))
            if record.WhichOneof("record_type") != "history":
                continue
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            for key, value in items.items():
                if key.startswith("val/generations/"):  # the table's file: its row count
                    key, value = "val/generations", items["val/generations/nrows"]
                if not key.startswith("_") and isinstance(value, int | float):
                    values.setdefault(key, {})[items["_step"]] = value
    return runs, values


def mlflow_values(run: Path) -> tuple[tuple, list[str], dict[str, dict[int, float]]]:
    """The (experiment, run name), generation artifacts and metric history of the run's
    MLflow run."""
    from mlflow import MlflowClient

    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=f"sqlite:///{(run / 'mlflow.db').resolve()}")
    keys = client.get_run(run_id).data.metrics
    history = {k: {m.step: m.value for m in client.get_metric_history(run_id, k)} for k in keys}
    artifacts = [a.path for a in client.list_artifacts(run_id, "val_generations")]
    info = client.get_run(run_id).info
    names = (client.get_experiment(info.experiment_id).name, info.run_name)
    return names, artifacts, history


def as_series(records: list[dict]) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for r in records:
        for key, value in r.items():
            if key != "step":
                out.setdefault(key, {})[r["step"]] = value
    return out


def assert_same(found: dict[str, dict[int, float]], expected: dict, rel: float) -> None:
    assert set(found) == set(expected)
    for key, series in expected.items():
        assert set(found[key]) == set(series), key
        for step, value in series.items():
            assert math.isclose(found[key][step], value, rel_tol=rel, abs_tol=1e-30), (key, step)


def test_trackers_hold_what_metrics_jsonl_holds_and_resume(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = tmp_path / "run"
    common = [*overrides(run, steps=3), LOGGERS, "trainer.log_val_generations=4"]
    common += ["trainer.save_freq=1", "trainer.project_name=arith", "trainer.experiment_name=e1"]
    assert main([*common, "trainer.stop_at_step=1"]) == 0
    first_ids = json.loads((run / "trackers.json").read_text())
    assert main(common) == 0  # resumes at step 1
    assert json.loads((run / "trackers.json").read_text()) == first_ids
    expected = as_series(read_records(run))
    assert set(expected["critic/score/mean"]) == {1, 2, 3}
    assert_same(tensorboard_values(run), expected, rel=1e-6)  # TensorBoard keeps float32
    wandb_runs, wandb_history = wandb_values(run)
    assert wandb_runs == {(first_ids["wandb"], "arith", "e1")}  # both segments: one run
    assert wandb_history.pop("val/generations") == {0: 4, 1: 4, 2: 4, 3: 4}  # 4 rows each
    assert_same(wandb_history, expected, rel=0)
    names, artifacts, mlflow_history = mlflow_values(run)
    assert names == ("arith", "e1")
    assert_same(mlflow_history, expected, rel=0)
    assert artifacts == [f"val_generations/step_00000{i}.json" for i in range(4)]
    # 4 generations at each validation step (test_freq=1: steps 0-3), in every sink
    rows = [json.loads(line) for line in (run / "val_generations.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert {"prompt", "response", "ground_truth", "score"} <= set(rows[0])


def test_only_the_chosen_sinks_are_written(tmp_path, monkeypatch, capsys) -> None:
    run = tmp_path / "run"
    assert main([*overrides(run, steps=1), "trainer.logger=[tensorboard]"]) == 0
    assert not (run / "metrics.jsonl").exists()  # no file
    assert "klppo run finished" not in capsys.readouterr().out  # no console
    assert set(tensorboard_values(run)["critic/score/mean"]) == {1}
    assert not (run / "wandb").exists() and not (run / "mlflow.db").exists()


@pytest.mark.parametrize("backend", ["wandb", "mlflow", "tensorboard"])
def test_a_missing_tracker_names_its_extra(monkeypatch, backend) -> None:
    monkeypatch.setitem(sys.modules, backend, None)  # how Python marks a module unimportable
    cfg = load_config(None, [f"trainer.logger=[console,{backend}]"])
    with pytest.raises(ValueError, match=rf"klppo-train\[{backend}\]"):
        validate_config(cfg)


def test_logger_names_and_verl_spelling() -> None:
    with pytest.raises(ValueError, match="'swanlab' is not a logger"):
        validate_config(load_config(None, ["trainer.logger=[swanlab]"]))
    assert load_config(None, ["trainer.logger=console"]).trainer.logger == ("console",)


def test_a_damaged_line_before_the_last_is_named_not_dropped(tmp_path: Path) -> None:
    """Only a last line can be a crash's partial append; a bad line before it is damage the
    reader does not paper over: one UserError naming the file and the line."""
    from klppo_train.config.errors import UserError
    from klppo_train.tracking.metrics_log import read_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "x\n{"step": 2}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl: line 2 is not JSON"):
        read_jsonl(path)
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "x')
    assert read_jsonl(path) == [{"step": 0}, {"step": 1}]
    assert read_jsonl(path, up_to_step=0) == [{"step": 0}]
