"""Every user error exits 2 before any model loads, with one line naming the key, file or
row, and no traceback: bad configurations, recipes and data files, run through ``main``."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import klppo_train.__main__ as entry
from klppo_train.checks.preflight import preflight
from klppo_train.config.schema import load_config
from klppo_train.data.datasets import write_parquet
from klppo_train.demo.tasks import COMPACT, make_arithmetic_rows

GOOD = make_arithmetic_rows(64, seed=0, template=COMPACT)


def _row(**changes):
    row = {k: v for k, v in GOOD[0].items() if k != "extra_info"}
    row.update(changes)
    return {k: v for k, v in row.items() if v is not ...}


def _raw_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)  # no validation: bad rows on purpose
    return path


@pytest.fixture
def run(tmp_path, monkeypatch):
    """``main`` on the embedded default with good data in ``tmp_path`` and the given extras;
    reaching ``train`` (which loads the models) fails the test."""
    write_parquet(GOOD, tmp_path / "train.parquet")
    write_parquet(GOOD[:16], tmp_path / "val.parquet")

    def reached_train(*args, **kwargs):
        raise AssertionError("a model would load: the error was not caught before train()")

    for task, steps in entry.TASKS.items():  # PPO and reward-model runs
        monkeypatch.setitem(entry.TASKS, task, steps._replace(train=reached_train))

    def call(*args: str) -> int:
        base = [
            f"trainer.run_dir={tmp_path / 'run'}",
            f"data.train_files=[{tmp_path / 'train.parquet'}]",
            f"data.val_files=[{tmp_path / 'val.parquet'}]",
        ]
        recipe = [a for a in args if a.endswith(".yaml") or a.startswith("RECIPE:")]
        rest = [a for a in args if a not in recipe]
        recipe = [r.removeprefix("RECIPE:") for r in recipe]
        return entry.main([*recipe, *base, *rest])

    return call


def _expect_one_line_exit_2(run, capsys, args, match) -> None:
    assert run(*args) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "\n" not in err, err
    assert err.startswith("klppo-train: error: "), err
    assert match in err, err


CUSTOM_REWARD = "def score(data_source, solution_str, ground_truth, extra_info):\n    return 1.0\n"

BAD_CONFIGS = [
    (["actor.ppo_mini_batch_size=0"], "actor.ppo_mini_batch_size must be >= 1"),
    (["actor.ppo_max_token_len_per_gpu=lots"], "actor.ppo_max_token_len_per_gpu='lots'"),
    (["ref.log_prob_max_token_len_per_gpu=0"], "ref.log_prob_max_token_len_per_gpu must be"),
    (["trainer.memory_limit_gib=-2"], "trainer.memory_limit_gib must be >= 0"),
    (
        ["critic.use_dynamic_bsz=false", "critic.ppo_max_token_len_per_gpu=auto"],
        "critic.ppo_max_token_len_per_gpu=auto with critic.use_dynamic_bsz=false",
    ),
    (["actor.ppo_mini_batch_size=-16"], "actor.ppo_mini_batch_size must be >= 1"),
    (["critic.ppo_mini_batch_size=0"], "critic.ppo_mini_batch_size must be >= 1"),
    (["actor.ppo_micro_batch_size_per_gpu=0"], "actor.ppo_micro_batch_size_per_gpu"),
    (["critic.ppo_epochs=0"], "critic.ppo_epochs must be >= 1"),
    (["actor.ppo_epochs=0"], "actor.ppo_epochs must be >= 1"),
    (["actor.grad_clip=0"], "actor.grad_clip must be > 0"),
    (["critic.grad_clip=-1.0"], "critic.grad_clip must be > 0"),
    (["trainer.total_training_steps=-1"], "trainer.total_training_steps must be >= 0"),
    (["trainer.total_epochs=0"], "trainer.total_epochs must be >= 1"),
    (["rollout.max_num_seqs=0"], "rollout.vllm.max_num_seqs must be >= 1"),
    (["rollout.kv_cache_space_gib=-1"], "rollout.vllm.kv_cache_space_gib must be > 0"),
    (
        ["rollout.gpu_memory_utilization=1.5"],
        "rollout.vllm.gpu_memory_utilization must be in (0, 1]",
    ),
    (["rollout.gpu_memory_utilization=0"], "rollout.vllm.gpu_memory_utilization must be in (0, 1]"),
    (["rollout.n=0"], "rollout.sampling.n must be >= 1"),
    (["rollout.top_p=0"], "top_p"),
    (["algorithm.kl_ctrl.kl_coef=0"], "algorithm.kl_ctrl.kl_coef must be > 0 with"),
    (["algorithm.kl_ctrl.horizon=10"], "algorithm.kl_ctrl.horizon=10 is too small"),
    (["actor.fsdp.fsdp_size=3"], "actor.fsdp.fsdp_size=3"),
    (["actor.ppo_max_token_len_per_gpu=10"], "actor.ppo_max_token_len_per_gpu"),
    (["actor.ppo_max_token_len_per_gpu=0"], "actor.ppo_max_token_len_per_gpu must be >= 1"),
    (
        ["actor.use_dynamic_bsz=false", "ref.log_prob_max_token_len_per_gpu=-5"],
        "ref.log_prob_max_token_len_per_gpu must be >= 1",
    ),
    (
        ["actor.use_dynamic_bsz=false", "actor.ppo_micro_batch_size_per_gpu=3"],
        "not divisible by actor.ppo_micro_batch_size_per_gpu=3",
    ),
    (
        ["critic.use_dynamic_bsz=false", "critic.ppo_micro_batch_size_per_gpu=3"],
        "not divisible by critic.ppo_micro_batch_size_per_gpu=3",
    ),
    (
        ["rollout.log_prob_micro_batch_size_per_gpu=0"],
        "rollout.log_prob_micro_batch_size_per_gpu must be >= 1",
    ),
    (["ref.fsdp.optimizer_offload=true"], "the reference has no optimizer"),
    (["rollout.max_num_batched_tokens=0"], "rollout.vllm.max_num_batched_tokens must be >= 1"),
    (["actor.fsdp.min_num_params=100", "actor.fsdp.wrap_policy=[Qwen2MLP]"], "actor.fsdp"),
    (["rollout.vllm.seed=3"], "rollout.vllm.seed=3: set by klppo"),
    (
        ["actor.fsdp.strategy=fsdp1", "actor.fsdp.param_offload=true"],
        "FSDP1's CPUOffload gives incorrect gradients",
    ),
    (["rollout.hf.max_tokens_per_batch=0"], "rollout.hf.max_tokens_per_batch must be >= 1"),
    (["critic.fsdp.mixed_precision.param_dtype=half"], "critic.fsdp.mixed_precision.param_dtype"),
    (
        ["trainer.allocator=jemalloc"],
        "trainer.allocator='jemalloc'; valid: auto, tcmalloc, glibc",
    ),
    (["actor.foo=1"], "unknown config key 'actor.foo'"),
    (["actor.lr=abc"], "actor.lr"),
    (["actor.lr=0"], "actor.lr must be > 0"),
    (["actor.clip_ratio_low=1.5"], "actor.clip_ratio_low must be in (0, 1)"),
    (["algorithm.gamma=2"], "algorithm.gamma must be in [0, 1]"),
    (["rollout.engine=sglang"], "rollout.engine='sglang'"),
    (["model.dtype=fp16"], "model.dtype='fp16'"),
    (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator='ppo'"),
    (["algorithm.adv_estimator=grpo", "rollout.n=1"], "rollout.n must be >= 2"),
    (["data.train_batch_size=30"], "data.train_batch_size=30 is not divisible"),
    (
        ["data.train_batch_size=80"],
        "64 usable prompts, fewer than one batch of data.train_batch_size=80",
    ),
    (["data.max_prompt_length=0"], "data.max_prompt_length must be an int >= 1"),
    (["data.truncation=middle"], "data.truncation must be one of"),
    (["data.train_files=[]"], "data.train_files is empty"),
    (["reward.custom=no_such_file.py:score"], "reward.custom: custom reward file"),
    (["reward.custom=not-a-spec"], "reward.custom: custom reward 'not-a-spec' must look like"),
    (["reward.custom=CUSTOM:nothere"], "has no function 'nothere'"),
    (["trainer.resume_mode=/no/such/checkpoint"], "trainer.resume_mode='/no/such/checkpoint'"),
    (["model.path=/no/such/model"], "model.path='/no/such/model': no HF model directory"),
    (["RECIPE:no_such_recipe.yaml"], "no_such_recipe.yaml"),
    (["RECIPE:DIR.yaml"], "DIR.yaml"),
    (["RECIPE:BROKEN.yaml"], "BROKEN.yaml"),
    (["trainer.val_only=true", "data.val_files=[]"], "data.val_files is empty (nothing to"),
    (["trainer.val_only=true", "trainer.task=reward_model"], "only with trainer.task=ppo"),
    (
        ["trainer.val_only=true", "reward_model.enable=true", "reward_model.path=rm"]
        + ["reward_model.forward_max_token_len_per_gpu=auto"],
        "is not probed in a validation-only run",
    ),
    (
        ["trainer.val_only=true", "reward_model.enable=true", "reward_model.path=rm"]
        + ["reward_model.normalize=reference"],
        "reads the training run's statistics",
    ),
    (["trainer.logger=[console,tensorboardx]"], "'tensorboardx' is not a logger"),
    (["trainer.log_val_generations=-1"], "trainer.log_val_generations must be >= 0"),
]


if not torch.cuda.is_available():  # on CUDA the offloads are real (scripts/gpu_check.sh)
    BAD_CONFIGS += [
        (["critic.fsdp.optimizer_offload=true"], "critic.fsdp.optimizer_offload=true only"),
        (["actor.fsdp.param_offload=true"], "actor.fsdp.param_offload=true only takes effect"),
        (["ref.fsdp.offload_policy=true"], "ref.fsdp.offload_policy=true only takes effect"),
        (["actor.fsdp.activation_offload=true"], "actor.fsdp.activation_offload=true only"),
    ]


@pytest.mark.parametrize(("args", "match"), BAD_CONFIGS, ids=lambda a: " ".join(a)[:60])
def test_bad_configuration_exits_2_before_any_model(run, capsys, tmp_path, args, match) -> None:
    (tmp_path / "reward.py").write_text(CUSTOM_REWARD)
    (tmp_path / "DIR.yaml").mkdir()
    (tmp_path / "BROKEN.yaml").write_text("actor:\n  lr: [1, 2\n  n: 3\n")
    args = [
        a.replace("CUSTOM", str(tmp_path / "reward.py"))
        .replace("RECIPE:DIR", f"RECIPE:{tmp_path / 'DIR'}")
        .replace("RECIPE:BROKEN", f"RECIPE:{tmp_path / 'BROKEN'}")
        for a in args
    ]
    _expect_one_line_exit_2(run, capsys, args, match)


def test_model_compile_without_a_cpp_compiler_exits_2_before_any_model(
    run, capsys, monkeypatch
) -> None:
    import torch._inductor.config as inductor

    monkeypatch.setattr(inductor.cpp, "cxx", ("/no/such/c++",))
    _expect_one_line_exit_2(run, capsys, ["model.compile=true"], "model.compile=true needs a C++")


def _bad_files(d: Path) -> dict[str, tuple[Path, str]]:
    """name → (a bad training file, what the error must say)."""
    (d / "garbage.parquet").write_bytes(b"this is not parquet")
    (d / "folder.parquet").mkdir()
    long_prompt = [{"role": "user", "content": "9" * 100}]
    return {
        "missing": (d / "missing.parquet", "missing.parquet' does not exist"),
        "directory": (d / "folder.parquet", "is a directory, not a parquet file"),
        "not parquet": (d / "garbage.parquet", "is not a readable parquet file"),
        "no rows": (_raw_parquet(d / "empty.parquet", []), "has no rows"),
        "no prompt column": (
            _raw_parquet(d / "noprompt.parquet", [_row(prompt=...)]),
            "row 0: 'prompt' must be",
        ),
        "prompt is a string": (
            _raw_parquet(d / "strprompt.parquet", [_row(prompt="3+4=")]),
            "row 0: 'prompt' must be",
        ),
        "message without role": (
            _raw_parquet(d / "norole.parquet", [_row(prompt=[{"content": "3+4="}])]),
            "row 0: 'prompt' must be",
        ),
        "no ground truth": (
            _raw_parquet(d / "nogt.parquet", [_row(reward_model={"style": "rule"})]),
            "row 0: 'reward_model' must be",
        ),
        "empty data_source": (
            _raw_parquet(d / "nosource.parquet", [_row(data_source="")]),
            "row 0: 'data_source' must be a non-empty str",
        ),
        "extra_info not a dict": (
            _raw_parquet(d / "extra.parquet", [_row(extra_info=3)]),
            "row 0: 'extra_info' must be a dict",
        ),
        "second row bad": (
            _raw_parquet(d / "second.parquet", [_row(), _row(ability="")]),
            "row 1: 'ability' must be a non-empty str",
        ),
        "unknown data_source": (
            _raw_parquet(d / "unknown.parquet", [_row(data_source="my/task")] * 40),
            "data.train_files row 0: data_source 'my/task' has no built-in reward",
        ),
        "every prompt too long": (
            _raw_parquet(d / "long.parquet", [_row(prompt=long_prompt)] * 40),
            "data.train_files: all 40 prompts are longer than data.max_prompt_length=24",
        ),
        "fewer rows than a batch": (
            _raw_parquet(d / "few.parquet", [_row()] * 10),
            "10 usable prompts, fewer than one batch of data.train_batch_size=32",
        ),
    }


BAD_FILE_NAMES = [
    "missing",
    "directory",
    "not parquet",
    "no rows",
    "no prompt column",
    "prompt is a string",
    "message without role",
    "no ground truth",
    "empty data_source",
    "extra_info not a dict",
    "second row bad",
    "unknown data_source",
    "every prompt too long",
    "fewer rows than a batch",
]


@pytest.mark.parametrize("name", BAD_FILE_NAMES)
@pytest.mark.parametrize("role", ["train_files", "val_files"])
def test_bad_data_file_exits_2_naming_it(run, capsys, tmp_path, name, role) -> None:
    path, match = _bad_files(tmp_path)[name]
    if role == "val_files" and name == "fewer rows than a batch":
        # A validation set needs no full batch: this one passes every check (to train()).
        with pytest.raises(AssertionError, match="a model would load"):
            run(f"data.val_files=[{path}]")
    else:
        match = match.replace("data.train_files", f"data.{role}")
        _expect_one_line_exit_2(run, capsys, [f"data.{role}=[{path}]"], match)


def test_long_prompt_with_truncation_error_names_the_row(run, capsys, tmp_path) -> None:
    rows = [_row()] * 39 + [_row(prompt=[{"role": "user", "content": "9" * 100}])]
    path = _raw_parquet(tmp_path / "one_long.parquet", rows)
    args = [f"data.train_files=[{path}]", "data.filter_overlong_prompts=false"]
    _expect_one_line_exit_2(run, capsys, args, "data.train_files: row 39")


def test_filtered_prompts_are_counted(tmp_path, caplog) -> None:
    rows = [_row()] * 40 + [_row(prompt=[{"role": "user", "content": "9" * 100}])] * 3
    path = _raw_parquet(tmp_path / "some_long.parquet", rows)
    cfg = load_config(
        None,
        [f"trainer.run_dir={tmp_path}", f"data.train_files=[{path}]", "data.max_prompt_length=24"],
    )
    with caplog.at_level(logging.INFO, logger="klppo_train"):
        checked = preflight(cfg)
    assert len(checked.train) == 40
    assert "dropped 3 of 43 prompts longer than data.max_prompt_length=24" in caplog.text


def test_embedded_default_generates_data_only_at_its_own_paths(run, capsys, tmp_path) -> None:
    typo = tmp_path / "run" / "dat" / "train.parquet"
    _expect_one_line_exit_2(run, capsys, [f"data.train_files=[{typo}]"], "does not exist")
    assert not typo.exists()
    own = tmp_path / "run" / "data" / "train.parquet"
    with pytest.raises(AssertionError, match="a model would load"):
        run(f"data.train_files=[{own}]")
    assert own.is_file()


def test_debug_shows_the_traceback(run) -> None:
    with pytest.raises(Exception, match="actor.grad_clip must be > 0"):
        run("actor.grad_clip=0", "--debug")


def test_ulysses_alone_passes_the_checks_and_turns_prompt_sharing_off(
    run, capsys, caplog, monkeypatch
) -> None:
    """Issue 40: verl's Ulysses key alone at world size 2 reaches the run (model.share_prompts
    unset gives way, in one log line); model.share_prompts=true set with it exits 2."""
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun --nproc-per-node=2 sets it
    sp = "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"
    _expect_one_line_exit_2(
        run,
        capsys,
        [sp, "model.share_prompts=true"],
        "model.share_prompts=true with actor.ulysses_sequence_parallel_size=2",
    )
    with (
        caplog.at_level("INFO", logger="klppo_train"),
        pytest.raises(AssertionError, match="a model would load"),
    ):
        run(sp)
    assert (
        "model.share_prompts off: Ulysses sequence parallelism "
        "(actor.ulysses_sequence_parallel_size=2) does not share prompts"
    ) in caplog.messages


# ------------------------------------------------------------------ the reward model


def _exit_2_matching(run, capsys, args, pattern) -> None:
    assert run(*args) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "\n" not in err, err
    assert re.search(pattern, err), err


def _tiny_model_dir(path: Path, reward_model: bool = False, stats: bool = False) -> Path:
    """A saved tiny model; ``reward_model``: its config says it is one (a sequence
    classifier with one label; the weights do not matter before any model loads)."""
    import json

    from klppo_train.demo.embedded import build_model, build_tokenizer
    from klppo_train.runtime.hf_dirs import save_atomically

    tokenizer = build_tokenizer()
    save_atomically(build_model(len(tokenizer), seed=0, hidden=64), tokenizer, path)
    if reward_model:
        config = json.loads((path / "config.json").read_text())
        config.update(architectures=["Qwen2ForSequenceClassification"], id2label={"0": "L"})
        config.update({"mean": 0.5, "std": 2.0} if stats else {})
        (path / "config.json").write_text(json.dumps(config))
    return path


def test_bad_preference_data_exits_2_naming_the_row(run, capsys, tmp_path) -> None:
    model = _tiny_model_dir(tmp_path / "model")
    capsys.readouterr()  # its save's progress bar
    good = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
    path = _raw_parquet(tmp_path / "pairs.parquet", [good] * 3 + [{**good, "chosen": ""}])
    args = ["trainer.task=reward_model", f"model.path={model}", f"data.train_files=[{path}]"]
    _exit_2_matching(run, capsys, args, rf"data.train_files: {path} row 3: 'chosen'")
    ppo_rows = ["trainer.task=reward_model", f"model.path={model}"]  # the fixture's PPO rows
    _exit_2_matching(run, capsys, ppo_rows, r"row 0: 'chosen' must be")


def test_a_bad_reward_model_directory_exits_2(run, capsys, tmp_path) -> None:
    causal = _tiny_model_dir(tmp_path / "causal")
    bare = _tiny_model_dir(tmp_path / "bare", reward_model=True)
    capsys.readouterr()  # their saves' progress bars
    on = ["reward_model.enable=true"]
    cases = [
        ([f"reward_model.path={tmp_path / 'none'}"], "reward_model.path=.*no HF model directory"),
        ([f"reward_model.path={causal}"], "reward_model.path=.*not a reward model"),
        (
            [f"reward_model.path={bare}", "reward_model.normalize=stored"],
            "reward_model.normalize=stored: .* holds no mean/std",
        ),
        ([], "reward_model.enable=true needs reward_model.path"),
    ]
    for args, match in cases:
        _exit_2_matching(run, capsys, [*on, *args], match)
    critic = [f"critic.model_path={tmp_path / 'none'}"]
    _exit_2_matching(run, capsys, critic, "critic.model_path=.*no HF model directory")


def test_a_bad_ensemble_member_exits_2(run, capsys, tmp_path) -> None:
    """Each member is a reward-model directory that reads reward_model.path's token ids, has
    its shape and stores the mean/std its scores are standardized by (the first's too)."""
    import json

    good = _tiny_model_dir(tmp_path / "good", reward_model=True, stats=True)
    bare = _tiny_model_dir(tmp_path / "bare", reward_model=True)
    other = _tiny_model_dir(tmp_path / "other", reward_model=True, stats=True)
    (other / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    wider = _tiny_model_dir(tmp_path / "wider", reward_model=True, stats=True)
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    capsys.readouterr()  # their saves' progress bars
    on = ["reward_model.enable=true"]
    member = r"reward_model.ensemble.paths\[0\]="
    cases = [
        ([f"reward_model.path={good}", f"reward_model.ensemble.paths=[{tmp_path / 'none'}]"],
         member + ".*no HF model directory"),
        ([f"reward_model.path={good}", f"reward_model.ensemble.paths=[{bare}]"],
         member + ".*holds no mean/std"),
        ([f"reward_model.path={bare}", f"reward_model.ensemble.paths=[{good}]"],
         "reward_model.path=.*holds no mean/std"),
        ([f"reward_model.path={good}", f"reward_model.ensemble.paths=[{other}]"],
         member + ".*tokenizer or chat template differs"),
        ([f"reward_model.path={good}", "reward_model.ensemble.reduce=max"],
         "reward_model.ensemble.reduce='max'; valid: min, mean"),
        ([f"reward_model.path={good}", f"reward_model.ensemble.paths=[{wider}]"],
         member + ".*its hidden_size differ from reward_model.path's"),
        ([f"reward_model.path={good}", "reward_model.ensemble.reduce=mean"],
         "reduce takes effect only with reward_model.ensemble.paths"),
    ]  # fmt: skip
    for args, match in cases:
        _exit_2_matching(run, capsys, [*on, *args], match)
    off = [f"reward_model.ensemble.paths=[{good}]"]
    _exit_2_matching(run, capsys, off, "no reward model to join")


HEAVY = ("torch", "transformers", "vllm")
# What main() answers before torch, transformers or vLLM is imported: a typo'd key, a
# structurally bad data row, --help. In a fresh interpreter: this test process has torch.
FAST_ANSWERS = {
    "unknown key": (["foo.bar=1"], 2, "unknown config key 'foo.bar'"),
    "bad row": (["data.train_files=[BAD]"], 2, "row 0: 'prompt' must be"),
    "bad value": (["actor.ppo_mini_batch_size=0"], 2, "actor.ppo_mini_batch_size must be"),
    "help": (["--help"], 0, "usage: klppo-train"),
}


@pytest.mark.parametrize("name", FAST_ANSWERS)
def test_errors_answer_before_torch_loads(tmp_path, name) -> None:
    args, code, says = FAST_ANSWERS[name]
    bad = _raw_parquet(tmp_path / "bad.parquet", [_row(prompt=...)] * 40)
    args = [a.replace("BAD", str(bad)) for a in args] + [f"trainer.run_dir={tmp_path / 'run'}"]
    script = (
        "import sys\n"
        "from klppo_train.__main__ import main\n"
        f"try:\n    code = main({args!r})\nexcept SystemExit as exit:\n    code = exit.code\n"
        f"print('RESULT', code, sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert f"RESULT {code} []" in out.stdout, out.stdout + out.stderr
    assert says in out.stdout + out.stderr


def test_config_modules_import_no_torch() -> None:
    modules = [f"klppo_train.{m}" for m in CONFIG_MODULES]
    script = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n    importlib.import_module(m)\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


CONFIG_MODULES = (
    "config",
    *(f"config.{m}" for m in ("schema", "data", "roles", "explain", "verl_names", "errors")),
    "config.choices",
    "checks",
    "checks.validate",
    "checks.preflight",
    "runtime.launch",
    "cli",
)
