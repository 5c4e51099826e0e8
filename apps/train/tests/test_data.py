"""verl-format prompt data: config checks, parquet I/O, tokenization, loader, built-in tasks."""

import json
import re
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from klppo_train.data.datasets import (
    DataConfig,
    PromptDataset,
    PromptLoader,
    check_row,
    read_rows,
    write_parquet,
)
from klppo_train.demo.tasks import arithmetic_split, gsm8k_rows, main, make_arithmetic_rows

# One token per character, so a prompt's length is the length of its rendered text.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "[PAD]": 1, "[EOS]": 2}
    for c in [chr(i) for i in range(32, 127)] + ["\n"]:
        vocab[c] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
    )
    tok.chat_template = TEMPLATE
    return tok


def ids_of(tok, text: str) -> list[int]:
    return [tok.get_vocab()[c] for c in text]


def row(content: str, ground_truth: str = "7", **extra) -> dict:
    return {
        "data_source": "arithmetic",
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": extra,
    }


def config(**kwargs) -> DataConfig:
    return DataConfig(train_files=("train.parquet",), val_files=(), **kwargs)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"truncation": "middle"}, "data.truncation must be one of"),
        ({"max_prompt_length": 0}, "data.max_prompt_length must be an int >= 1"),
        ({"max_prompt_length": True}, "data.max_prompt_length"),
        ({"train_batch_size": 0}, "data.train_batch_size"),
        ({"val_batch_size": 0}, "data.val_batch_size"),
        ({"shuffle": "yes"}, "data.shuffle must be a bool"),
        ({"train_files": ("a.parquet", 3)}, "data.train_files must hold non-empty"),
        ({"val_files": ("",)}, "data.val_files must hold non-empty paths"),
    ],
)
def test_config_rejects_bad_fields(kwargs, message) -> None:
    base = {"train_files": ("t.parquet",), "val_files": ()}
    with pytest.raises(ValueError, match=re.escape(message)):
        DataConfig(**{**base, **kwargs})


def test_config_accepts_a_single_path_and_omegaconf() -> None:
    assert DataConfig().train_files == ()  # the app config's schema default
    cfg = DataConfig(train_files="a.parquet", val_files=["b.parquet", "c.parquet"])
    assert cfg.train_files == ("a.parquet",) and cfg.val_files == ("b.parquet", "c.parquet")
    omegaconf = pytest.importorskip("omegaconf")
    merged = omegaconf.OmegaConf.merge(
        omegaconf.OmegaConf.structured(DataConfig),
        {"train_files": ["x.parquet"], "val_files": [], "val_batch_size": 4},
    )
    assert omegaconf.OmegaConf.to_object(merged) == DataConfig(
        train_files=("x.parquet",), val_batch_size=4
    )


# ---------------------------------------------------------------- parquet rows


def test_parquet_round_trip(tmp_path) -> None:
    rows = [row("What is 1 + 1?", "2", index=0), row("What is 2 + 5?", "7", index=1)]
    path = tmp_path / "sub" / "train.parquet"
    write_parquet(rows, path)
    assert read_rows(path) == rows
    assert sorted(p.name for p in path.parent.iterdir()) == ["train.parquet"]  # no temp left
    # no extra_info anywhere: the column is left out and read back as {}
    write_parquet([row("a"), row("b")], tmp_path / "plain.parquet")
    assert "extra_info" not in pq.read_table(tmp_path / "plain.parquet").column_names
    back = read_rows([str(tmp_path / "plain.parquet"), path])
    assert [r["extra_info"] for r in back] == [{}, {}, {"index": 0}, {"index": 1}]


def test_paths_expand_the_home_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    rows = [row("What is 1 + 1?", "2")]
    write_parquet(rows, tmp_path / "d" / "train.parquet")
    assert read_rows("~/d/train.parquet") == rows


def test_bad_rows_are_named_by_file_and_index(tmp_path) -> None:
    rows = [row("ok", index=i) for i in range(3)]
    rows[2]["prompt"] = []
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)  # bypass write_parquet's own check
    with pytest.raises(ValueError, match=r"train\.parquet row 2: 'prompt' must be a non-empty"):
        read_rows(path)
    no_reward = [{k: v for k, v in row("x", index=0).items() if k != "reward_model"}]
    pq.write_table(pa.Table.from_pylist(no_reward), path)
    with pytest.raises(ValueError, match=r"row 0: 'reward_model' must be"):
        read_rows(path)
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        read_rows([path, tmp_path / "missing.parquet"])


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"data_source": ""}, "'data_source'"),
        ({"ability": 3}, "'ability'"),
        ({"prompt": [{"role": "user"}]}, "'prompt'"),
        ({"prompt": [{"role": "", "content": "x"}]}, "'prompt'"),
        ({"prompt": "What is 1 + 1?"}, "'prompt'"),
        ({"reward_model": {"style": "rule", "ground_truth": 7}}, "'reward_model'"),
        ({"extra_info": [1, 2]}, "'extra_info'"),
    ],
)
def test_check_row_names_the_field(change, field) -> None:
    with pytest.raises(ValueError, match=re.escape(f"rows[5]: {field}")):
        check_row({**row("x"), **change}, "rows[5]")


# ---------------------------------------------------------------- dataset


def test_dataset_renders_the_chat_template(tokenizer) -> None:
    rows = [row("What is 3 + 4?", "7", index=9)]
    item = PromptDataset(rows, tokenizer, config())[0]
    text = "user: What is 3 + 4?\nassistant:"
    assert list(item.prompt_ids) == ids_of(tokenizer, text)
    assert (item.index, item.data_source, item.ground_truth) == (0, "arithmetic", "7")
    assert item.extra_info == {"index": 9}


def test_truncation_modes_and_filtering(tokenizer) -> None:
    # rendered lengths: "user: " 6 + content + "\nassistant:" 11
    rows = [row("abc"), row("x" * 13), row("0123456789" * 2)]  # 20, 30, 37 tokens
    full = "user: " + "0123456789" * 2 + "\nassistant:"
    strict = config(max_prompt_length=25, filter_overlong_prompts=False)
    with pytest.raises(ValueError, match=r"row 1 \(arithmetic\): prompt has 30 tokens.*=25"):
        PromptDataset(rows, tokenizer, strict)
    left = PromptDataset(rows, tokenizer, replace(strict, truncation="left"))
    right = PromptDataset(rows, tokenizer, replace(strict, truncation="right"))
    assert list(left[2].prompt_ids) == ids_of(tokenizer, full[-25:])
    assert list(right[2].prompt_ids) == ids_of(tokenizer, full[:25])
    assert [len(i.prompt_ids) for i in left] == [20, 25, 25]
    filtered = PromptDataset(rows, tokenizer, config(max_prompt_length=30))
    assert filtered.num_filtered == 1 and [i.index for i in filtered] == [0, 1]


def test_tokenizer_without_chat_template_is_rejected(tokenizer) -> None:
    plain = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    with pytest.raises(ValueError, match="no chat_template"):
        PromptDataset([row("x")], plain, config())


# ---------------------------------------------------------------- loader


def epoch_batches(loader, n):
    return [loader.next_batch() for _ in range(n)]


def test_loader_is_deterministic_full_batches_and_reshuffles() -> None:
    data = list(range(10))
    a, b = PromptLoader(data, 3, seed=5), PromptLoader(data, 3, seed=5)
    first = list(a)
    assert first == list(b) and len(first) == len(a) == 3  # item 10th dropped
    assert all(len(batch) == 3 for batch in first)
    assert len({x for batch in first for x in batch}) == 9
    assert a.state_dict() == {"epoch": 1, "index": 0}
    assert list(a) != first  # epoch 1 has its own order (seed 6)
    assert list(PromptLoader(data, 3, seed=6)) != first
    assert list(PromptLoader(data, 4, shuffle=False)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_loader_resume_reproduces_the_remaining_batches() -> None:
    data = list(range(11))
    run = PromptLoader(data, 4, seed=3)
    epoch_batches(run, 3)  # crosses into epoch 1 (2 batches per epoch)
    state = run.state_dict()
    assert state == {"epoch": 1, "index": 4}
    expected = epoch_batches(run, 7)
    resumed = PromptLoader(data, 4, seed=3)
    resumed.load_state_dict(dict(state))
    assert epoch_batches(resumed, 7) == expected


def test_loader_rejects_bad_sizes_and_states() -> None:
    with pytest.raises(ValueError, match="fewer than one batch of batch_size=5"):
        PromptLoader([1, 2, 3], 5)
    loader = PromptLoader([1, 2, 3], 2)
    with pytest.raises(ValueError, match="'index'=4 exceeds the dataset size 3"):
        loader.load_state_dict({"epoch": 0, "index": 4})
    with pytest.raises(ValueError, match="'epoch' must be an int >= 0"):
        loader.load_state_dict({"index": 0})
    loader.load_state_dict({"epoch": 2, "index": 2})  # no full batch left: next epoch
    assert loader.state_dict() == {"epoch": 3, "index": 0}


# ---------------------------------------------------------------- built-in tasks and CLI


def test_arithmetic_rows() -> None:
    rows = make_arithmetic_rows(50, seed=0, max_operand=12, ops=("+", "-", "*"))
    assert rows == make_arithmetic_rows(50, seed=0, max_operand=12, ops=("+", "-", "*"))
    for i, r in enumerate(rows):
        a, op, b = re.fullmatch(
            r"What is (\d+) ([-+*]) (\d+)\? Answer with just the number\.",
            r["prompt"][0]["content"],
        ).groups()
        want = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert r["reward_model"]["ground_truth"] == str(want) and r["extra_info"] == {"index": i}
    assert any(r["reward_model"]["ground_truth"].startswith("-") for r in rows)
    with pytest.raises(ValueError, match="ops must be from"):
        make_arithmetic_rows(3, seed=0, ops=("/",))


def test_arithmetic_split_holds_out_its_validation_problems() -> None:
    train, val = arithmetic_split(500, 120, seed=0, max_operand=12, ops=("+", "-", "*"))
    question = [r["prompt"][0]["content"] for r in val]
    assert len(val) == 120 and len(set(question)) == 120  # distinct problems
    assert not set(question) & {r["prompt"][0]["content"] for r in train}  # never trained on
    assert len(train) == 500
    assert (train, val) == arithmetic_split(500, 120, seed=0, max_operand=12, ops=("+", "-", "*"))
    with pytest.raises(ValueError, match="held-out problems of only 4"):
        arithmetic_split(10, 4, seed=0, max_operand=1, ops=("+",))


def test_smollm2_task_asks_plainly_and_holds_out_its_validation() -> None:
    from klppo_train.demo.tasks import DATA_SOURCES

    train, val = DATA_SOURCES["arithmetic_chat"]()
    assert (len(train), len(val)) == (2000, 120)
    for row in (*train[:50], *val):
        question = row["prompt"][0]["content"]
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", question).groups()
        assert max(int(a), int(b)) <= 12 and row["data_source"] == "arithmetic_chat"
        want = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert row["reward_model"]["ground_truth"] == str(want)
    assert not {r["prompt"][0]["content"] for r in val} & {r["prompt"][0]["content"] for r in train}


def test_data_source_writes_only_the_recipes_own_missing_files(tmp_path) -> None:
    from klppo_train.checks.preflight import _prepare as prepare_data
    from klppo_train.config.schema import load_config

    run = tmp_path / "run"
    own = [
        f"data.train_files=[{run}/data/train.parquet]",
        f"data.val_files=[{run}/data/val.parquet]",
    ]
    cfg = load_config(None, ["data.source=arithmetic_chat", f"trainer.run_dir={run}", *own])
    prepare_data(cfg)
    train, val = read_rows(run / "data/train.parquet"), read_rows(run / "data/val.parquet")
    assert (len(train), len(val)) == (2000, 120) and train[0]["data_source"] == "arithmetic_chat"
    elsewhere = tmp_path / "typo" / "train.parquet"
    cfg = load_config(
        None,
        [
            "data.source=arithmetic_chat",
            f"trainer.run_dir={run}",
            f"data.train_files=[{elsewhere}]",
        ],
    )
    prepare_data(cfg)
    assert not elsewhere.exists()  # a mistyped path stays an error (preflight), not data


def test_arithmetic_cli_end_to_end(tmp_path, tokenizer) -> None:
    args = ["arithmetic", "--out", str(tmp_path / "d"), "--train", "20", "--val", "5"]
    assert main([*args, "--seed", "3"]) == 0
    train, val = read_rows(tmp_path / "d/train.parquet"), read_rows(tmp_path / "d/val.parquet")
    assert (len(train), len(val)) == (20, 5)
    assert train == make_arithmetic_rows(20, seed=3) and val == make_arithmetic_rows(5, seed=4)
    dataset = PromptDataset(train, tokenizer, config(max_prompt_length=64))
    batch = PromptLoader(dataset, 8, seed=1).next_batch()
    assert len(batch) == 8 and all(item.data_source == "arithmetic" for item in batch)


def test_gsm8k_conversion(tmp_path) -> None:
    lines = [
        {"question": "Tom has 3 apples. How many?", "answer": "3 apples.\n#### 3"},
        {"question": "Big?", "answer": "so 1,000 + 234\n#### 1,234"},
    ]
    src = tmp_path / "gsm8k.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    out = tmp_path / "gsm8k.parquet"
    assert main(["gsm8k", "--jsonl", str(src), "--out", str(out)]) == 0
    rows = read_rows(out)
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["3", "1234"]
    assert rows[0]["data_source"] == "openai/gsm8k"
    assert rows[0]["prompt"] == [
        {
            "role": "user",
            "content": "Tom has 3 apples. How many? Let's think step by step and output "
            'the final answer after "####".',
        }
    ]
    assert rows[1]["extra_info"]["answer"] == lines[1]["answer"]


@pytest.mark.parametrize(
    ("third_line", "message"),
    [
        ('{"question": "q", "answer": "no final marker"}', "line 3: 'answer' has no final"),
        ('{"question": "q"', "line 3: not valid JSON"),
        ('["q", "a"]', "line 3: expected an object"),
    ],
)
def test_gsm8k_bad_line_is_named(tmp_path, third_line, message) -> None:
    good = json.dumps({"question": "q", "answer": "#### 1"})
    src = tmp_path / "bad.jsonl"
    src.write_text(f"{good}\n{good}\n{third_line}\n")
    with pytest.raises(ValueError, match=re.escape(message)):
        gsm8k_rows(src)
