"""Multi-turn, tool-calling runs of the app (issue 42): verl's tool-config file, the checks
before any model loads, and real runs of a tiny model that calls the calculator
(:mod:`klppo_train.demo.tool_use`), PPO with a critic and GRPO, whose conversations reach
the trainer with the tools' tokens out of the loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_preflight import _exit_2_matching, run  # noqa: F401  (a fixture)

from klppo_train.__main__ import main
from klppo_train.agents.tool_config import load_tool_config
from klppo_train.data.datasets import PromptDataset, write_parquet
from klppo_train.demo.tasks import DATA_SOURCES
from klppo_train.demo.tool_use import SOURCE, tiny_calculator_model, tool_tokenizer

APP = Path(__file__).resolve().parents[1]
CALCULATOR = APP / "recipes" / "tools" / "calculator.yaml"
RECIPE = APP / "recipes" / "tiny_calculator.yaml"
SCHEMA = {
    "type": "function",
    "function": {
        "name": "NAME",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
USER_TOOL = """
class Doubler:
    def __init__(self, config, tool_schema):
        self.name = tool_schema["function"]["name"]
        self.schema = tool_schema
        self.factor = config.get("factor", 2)

    def call(self, arguments, context):
        return str(self.factor * len(arguments["expression"]))


class Raising(Doubler):
    def call(self, arguments, context):
        raise RuntimeError("the user's tool broke")


class NotATool:
    def __init__(self, config, tool_schema):
        pass


class Fails:
    def __init__(self, config, tool_schema):
        raise OSError("no licence")
"""


def _tools_file(path: Path, *entries: dict) -> Path:
    path.write_text(json.dumps({"tools": list(entries)}))  # JSON is YAML
    return path


def _entry(class_name: str, name: str = "calculator", **more) -> dict:
    schema = json.loads(json.dumps(SCHEMA).replace("NAME", name))
    return {"class_name": class_name, "tool_schema": schema, **more}


def test_the_shipped_tool_config_gives_the_calculator() -> None:
    (tool,) = load_tool_config(CALCULATOR)
    assert tool.name == "calculator"
    assert tool.schema["function"]["parameters"]["required"] == ["expression"]
    assert tool.call({"expression": "23 * 47"}, {}).text == "1081"


def test_a_users_tool_class_loads_from_a_file_or_a_module(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_tools.py").write_text(USER_TOOL)
    by_file = _entry("my_tools.py:Doubler", "double", config={"factor": 3})
    config = _tools_file(tmp_path / "tools.yaml", by_file)
    (tool,) = load_tool_config(config)  # relative to the tool config's folder
    assert (tool.name, tool.call({"expression": "abcd"}, {})) == ("double", "12")
    monkeypatch.syspath_prepend(str(tmp_path))
    by_module = _entry("my_tools.Doubler", "twice")
    tools = load_tool_config(_tools_file(tmp_path / "two.yaml", by_module, _entry("calculator")))
    assert [t.name for t in tools] == ["twice", "calculator"]


BAD_TOOL_CONFIGS = [
    ([_entry("nope.Missing")], "tools[0]: class_name 'nope.Missing': No module named 'nope'"),
    ([_entry("Calculater")], "tools[0]: unknown class_name 'Calculater'"),
    ([_entry("my_tools.py:Absent")], "tools[0]: class_name 'my_tools.py:Absent': no class"),
    ([_entry("missing.py:Doubler")], "file 'missing.py' does not exist"),
    ([{"class_name": "my_tools.py:Doubler"}], "a tool of your own (my_tools.py:Doubler) needs"),
    ([_entry("my_tools.py:NotATool")], "NotATool gives no tool"),
    ([_entry("my_tools.py:Fails")], "Fails(config, tool_schema) failed: no licence"),
    ([_entry("calculator"), _entry("calculator")], "names must be unique, ['calculator']"),
    ([{**_entry("calculator"), "tool_schema": {"type": "function"}}], "needs function.name"),
    (
        [
            _entry("calculator")
            | {
                "tool_schema": {
                    **SCHEMA,
                    "function": {"name": "c", "parameters": {"type": "banana"}},
                }
            }
        ],
        "function.parameters is not a JSON schema",
    ),  # fmt: skip
    ([{"config": {}}], "tools[0]: needs class_name"),
]


@pytest.mark.parametrize(("entries", "says"), BAD_TOOL_CONFIGS, ids=lambda e: str(e)[:40])
def test_a_bad_tool_config_names_its_entry(tmp_path, entries, says) -> None:
    (tmp_path / "my_tools.py").write_text(USER_TOOL)
    config = _tools_file(tmp_path / "tools.yaml", *entries)
    with pytest.raises(ValueError) as raised:
        load_tool_config(config)
    assert str(raised.value).startswith(f"{config}: "), raised.value
    assert says in str(raised.value), raised.value


def test_a_tool_config_that_is_not_one(tmp_path) -> None:
    (tmp_path / "broken.yaml").write_text("tools: [a, b\n")
    with pytest.raises(ValueError, match="broken.yaml: not YAML"):
        load_tool_config(tmp_path / "broken.yaml")
    (tmp_path / "empty.yaml").write_text("tools: []\n")
    with pytest.raises(ValueError, match="needs a non-empty list"):
        load_tool_config(tmp_path / "empty.yaml")
    with pytest.raises(FileNotFoundError):
        load_tool_config(tmp_path / "absent.yaml")


def test_prompts_render_the_tools_where_the_template_can(tmp_path) -> None:
    from klppo_train.config.data import DataConfig
    from klppo_train.demo.embedded import build_tokenizer

    rows = DATA_SOURCES[SOURCE]()[1][:2]
    rows[1] = {**rows[1], "agent_name": "single_turn_agent"}
    schemas = [t.schema for t in load_tool_config(CALCULATOR)]
    tokenizer = tool_tokenizer()
    data = PromptDataset(rows, tokenizer, DataConfig(max_prompt_length=64), tools=schemas)
    texts = [tokenizer.decode(i.prompt_ids) for i in data.items]
    assert "tools: calculator" in texts[0] and "tools:" not in texts[1]  # single turn: none
    assert [i.agent_name for i in data.items] == ["", "single_turn_agent"]
    assert data.template_ignores_tools is False
    plain = PromptDataset(rows[:1], tokenizer, DataConfig(max_prompt_length=64))
    assert plain.template_ignores_tools is None  # no tools: not asked
    char = PromptDataset(rows[:1], build_tokenizer(), DataConfig(max_prompt_length=64), schemas)
    assert char.template_ignores_tools is True  # the embedded template has no tools variable


def test_bad_multi_turn_configuration_exits_2_before_any_model(run, capsys, tmp_path) -> None:  # noqa: F811
    (tmp_path / "my_tools.py").write_text(USER_TOOL)
    unknown = _tools_file(tmp_path / "unknown.yaml", _entry("Calculater"))
    on = "rollout.multi_turn.enable=true"
    cases = [
        ([on], r"rollout.multi_turn.enable=true needs rollout.multi_turn.tool_config_path"),
        ([f"rollout.multi_turn.tool_config_path={CALCULATOR}"], r"tool_config_path takes effect"),
        (["rollout.multi_turn.max_assistant_turns=2"], r"max_assistant_turns takes effect only"),
        ([on, "rollout.multi_turn.tool_config_path=/nope.yaml"], r"'/nope.yaml' does not exist"),
        ([on, f"rollout.multi_turn.tool_config_path={unknown}"], r"tools\[0\]: unknown class_name"),
        ([on, "rollout.multi_turn.format=xml"], r"rollout.multi_turn.format must be one of"),
        (
            [on, "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=top"],
            r"tool_response_truncate_side must be one of",
        ),
        # the embedded character template: its assistant turn does not end with the EOS
        ([on, f"rollout.multi_turn.tool_config_path={CALCULATOR}"], r"with the tokenizer of"),
    ]
    for args, pattern in cases:
        _exit_2_matching(run, capsys, args, pattern)


def test_a_rows_agent_must_be_one_the_run_has(run, capsys, tmp_path) -> None:  # noqa: F811
    from test_preflight import GOOD

    for agent, says in [
        ("react_agent", r"train_files row 3: agent_name='react_agent' is not one of tool_agent"),
        ("tool_agent", r"row 3: agent_name=tool_agent needs rollout.multi_turn.enable=true"),
    ]:
        rows = [dict(r) for r in GOOD]
        rows[3]["agent_name"] = agent
        write_parquet(rows, tmp_path / "agents.parquet")
        _exit_2_matching(run, capsys, [f"data.train_files=[{tmp_path / 'agents.parquet'}]"], says)


# ---------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> Path:
    """The tiny calculator model (built once: ~25 s) and its problems' parquet files."""
    root = tmp_path_factory.mktemp("tool_model")
    tiny_calculator_model(root / "model")
    train, val = DATA_SOURCES[SOURCE]()
    write_parquet(train[:64], root / "train.parquet")
    write_parquet(val[:16], root / "val.parquet")
    return root


def _args(root: Path, run_dir: Path, *more: str) -> list[str]:
    return [
        str(RECIPE),
        f"model.path={root / 'model'}",
        "model.source=''",
        f"data.train_files=[{root / 'train.parquet'}]",
        f"data.val_files=[{root / 'val.parquet'}]",
        f"rollout.multi_turn.tool_config_path={CALCULATOR}",
        f"trainer.run_dir={run_dir}",
        "trainer.total_training_steps=3",
        "trainer.test_freq=3",
        "trainer.save_freq=0",
        *more,
    ]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


ALGORITHMS = {
    "grpo": ["algorithm.adv_estimator=grpo"],
    "gae": ["algorithm.adv_estimator=gae", "critic.enable=true", "rollout.n=2",
            "critic.ppo_mini_batch_size=8", "actor.ppo_epochs=2"],
}  # fmt: skip


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_three_steps_learn_from_conversations_with_the_calculator(
    tool_model, tmp_path, algorithm
) -> None:
    run_dir = tmp_path / "run"
    more = ["rollout.engine=hf", "trainer.log_val_generations=4", *ALGORITHMS[algorithm]]
    assert main(_args(tool_model, run_dir, *more)) == 0
    steps = _metrics(run_dir)
    assert [r["step"] for r in steps if "actor/pg_loss" in r] == [1, 2, 3]
    for r in (r for r in steps if "actor/pg_loss" in r):
        assert r["tool/calls_per_sample"] > 0.5 and r["multi_turn/turns"] >= 2, r
        # sampled at T = 1 the tiny model writes a malformed call now and then
        assert r["multi_turn/tool_tokens"] > 0 and r["tool/error_rate"] <= 0.25
        # the response length is the whole conversation: generated and appended tokens
        assert r["response_length/mean"] > r["multi_turn/tool_tokens"]
        if algorithm == "gae":
            assert "critic/vf_loss" in r
    assert steps[-1]["val/tool/calls_per_sample"] > 0.5
    rows = [json.loads(x) for x in (run_dir / "val_generations.jsonl").read_text().splitlines()]
    roles = [[t["role"] for t in row["turns"]] for row in rows]
    assert ["assistant", "tool", "assistant"] in roles, roles
    called = next(row for row in rows if len(row["turns"]) == 3)
    assert "<tool_call>" in called["turns"][0]["content"]
    assert called["turns"][1]["content"].split()[1] in called["response"]  # the tool's answer


def test_a_tool_that_fails_is_an_answer_and_the_run_goes_on(tool_model, tmp_path) -> None:
    """Every call of a tool that raises is answered with the error; the run finishes and
    counts each one."""
    (tmp_path / "my_tools.py").write_text(USER_TOOL)
    raising = _tools_file(tmp_path / "raising.yaml", _entry("my_tools.py:Raising"))
    run_dir = tmp_path / "run"
    args = [*_args(tool_model, run_dir), f"rollout.multi_turn.tool_config_path={raising}"]
    assert main([*args, "rollout.engine=hf", "trainer.total_training_steps=2"]) == 0
    trained = [r for r in _metrics(run_dir) if "actor/pg_loss" in r]
    assert len(trained) == 2
    for r in trained:
        assert r["tool/error_rate"] == 1.0 and r["tool/calls_per_sample"] > 0.5
        assert r["tool/errors/raised"] == pytest.approx(r["tool/calls_per_sample"])


@pytest.mark.slow  # two GRPO steps at world size 1 and 2, vLLM in each process
def test_multi_turn_runs_are_the_same_at_world_size_1_and_2(tool_model, tmp_path) -> None:
    env = {
        **os.environ,
        "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", "/tmp/klppo_vllm"),
        "OMP_NUM_THREADS": "1",
    }
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
    ]
    found = []
    for name, launcher in (("one", [sys.executable]), ("two", torchrun)):
        run_dir = tmp_path / name
        args = _args(tool_model, run_dir, "trainer.total_training_steps=2")
        done = subprocess.run(
            [*launcher, "-m", "klppo_train", *args], capture_output=True, text=True,
            timeout=900, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
        found.append(_metrics(run_dir))
    alone, split = found
    for a, b in zip(alone[1:], split[1:], strict=True):
        for key in sorted(a):
            if key.startswith(("multi_turn/", "tool/", "val/", "critic/score")) or key in (
                "actor/pg_loss", "actor/entropy", "response_length/mean", "perf/response_tokens",
            ):  # fmt: skip
                assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (a["step"], key)


def test_smollm2s_calculator_problems_say_how_to_call_it_and_are_held_out() -> None:
    from klppo_train.data.datasets import check_row
    from klppo_train.demo.tasks import CALCULATOR_SYSTEM

    train, val = DATA_SOURCES["calculator_multiply_2digit"]()
    assert (len(train), len(val)) == (2000, 64)
    for i, row in enumerate(train + val):
        check_row(row, f"row {i}")
        assert row["prompt"][0] == {"role": "system", "content": CALCULATOR_SYSTEM}
        a, b = (int(x) for x in row["prompt"][1]["content"][8:-1].split("*"))
        assert 10 <= a <= 99 and 10 <= b <= 99 and row["reward_model"]["ground_truth"] == str(a * b)
    questions = {r["prompt"][1]["content"] for r in train}
    assert not questions & {r["prompt"][1]["content"] for r in val}
