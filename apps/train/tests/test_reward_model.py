"""The reward model: preference rows, the scored token, training (learns, resumes, exports
a directory transformers loads and scores alike), and its pieces in the PPO step
(re-templating, normalization, the combined reward, its budget's OOM back-off)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_step import components, scalar_head_model
from train_testing import prompt_response_batch

from klppo_train.budgets.faults import FAULTS
from klppo_train.budgets.run_budgets import RunBudgets
from klppo_train.config.data import DataConfig
from klppo_train.data.datasets import PromptDataset, write_parquet
from klppo_train.data.pairs import PairDataset, check_pair_row, read_pairs
from klppo_train.demo.embedded import build_model, build_tokenizer
from klppo_train.demo.tasks import make_arithmetic_rows
from klppo_train.ppo.step import calibrate_reward_model
from klppo_train.reward_model.serve import Retemplate, RewardModelReward, ended
from klppo_train.runtime.hf_dirs import save_atomically
from klppo_train.runtime.packed_attention import VARLEN
from klppo_train.workers.forward import response_scores
from klppo_train.workers.trajectories import Trajectories

P, T, VOCAB = 6, 5, 64

# ------------------------------------------------------------------ preference rows


def test_preference_rows_in_every_accepted_shape() -> None:
    messages = [{"role": "user", "content": "2+2="}]
    conventional = {
        "prompt": messages,
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
        "margin": 1.5,
    }
    plain = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
    implicit = {
        "chosen": [*messages, {"role": "assistant", "content": "4"}],
        "rejected": [*messages, {"role": "assistant", "content": "5"}],
    }
    want = {"prompt": messages, "chosen": "4", "rejected": "5", "margin": 0.0}
    assert check_pair_row(conventional, "r") == {**want, "margin": 1.5}
    assert check_pair_row(plain, "r") == want
    assert check_pair_row(implicit, "r") == want
    bad = [
        ({**plain, "chosen": None}, "r: 'chosen' must be"),
        ({**plain, "rejected": [{"role": "assistant"}]}, "r: 'rejected' must be"),
        ({**conventional, "chosen": [{"role": "user", "content": "4"}]}, "assistant's"),
        ({**plain, "margin": "big"}, "'margin' must be a finite number"),
        ({**implicit, "rejected": [{"role": "user", "content": "3+3="}, implicit["rejected"][1]]},
         "differ only in their last"),
    ]  # fmt: skip
    for row, match in bad:
        with pytest.raises(ValueError, match=match):
            check_pair_row(row, "r")


def test_bad_pair_file_names_the_row(tmp_path) -> None:
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 3
    rows[2] = {"prompt": "1+1=", "chosen": "2"}
    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(ValueError, match=rf"{path} row 2: 'rejected' must be"):
        read_pairs([str(path)])


# ------------------------------------------------------------------ the scored token


def _reward_model(vocab: int, seed: int = 3):
    actor = build_model(vocab, seed=0, hidden=64)
    model = scalar_head_model(actor, seed=seed, bias=False).eval()
    model.set_attn_implementation(VARLEN)
    return model


def _direct_score(model, ids: torch.Tensor) -> float:
    """The head at the last token of one unpadded sequence (no packing, no batch)."""
    with torch.no_grad():
        return float(model(ids[None]).logits[0, -1, 0])


def test_the_score_is_read_at_the_last_response_token() -> None:
    """pad == EOS (1 here), a response cut at T (no EOS), one ending on a custom stop token
    (7), a one-token response: each scored at its last valid token, as one sequence alone."""
    model = _reward_model(VOCAB)
    eos = pad = 1
    rows = [  # (prompt, response)
        ([5, 9, 12], [20, 21, eos]),
        ([33, 4], [40, 41, 42, 43, 44]),  # cut at T = 5
        ([6, 6, 6, 6], [7]),  # stopped on the custom stop token
        ([8], [30, 31, 7]),
    ]
    width = max(len(p) for p, _ in rows)
    ids = torch.full((len(rows), width + T), pad)
    mask = torch.zeros_like(ids)
    for i, (prompt, response) in enumerate(rows):
        ids[i, width - len(prompt) : width + len(response)] = torch.tensor(prompt + response)
        mask[i, width - len(prompt) : width + len(response)] = 1
    for budget in (10_000, 12):  # one micro-batch, or one sequence each
        with torch.no_grad():
            scores = response_scores(model, ids, mask, T, max_tokens=budget)
        want = [_direct_score(model, torch.tensor(p + r)) for p, r in rows]
        torch.testing.assert_close(scores, torch.tensor(want), rtol=0, atol=1e-5)
    # the token before a final EOS (what "the last non-pad token" reads when pad == EOS)
    assert abs(scores[0] - _direct_score(model, torch.tensor(rows[0][0] + rows[0][1][:-1]))) > 1e-4
    t = Trajectories(ids, mask, mask[:, width:], torch.zeros(4, T), torch.arange(4))
    assert ended(t, frozenset({eos, 7})).tolist() == [True, False, True, True]
    assert ended(t, frozenset({eos})).tolist() == [True, False, False, False]


# ------------------------------------------------------------------ training runs


def _pairs(n: int, seed: int) -> list[dict]:
    """Right answers against wrong ones, the wrong ones marked with a leading "x" (a
    preference the tiny model learns in a few steps)."""
    rows = make_arithmetic_rows(n, seed=seed, template="{a}{op}{b}=")
    return [
        {
            "prompt": r["prompt"],
            "chosen": r["reward_model"]["ground_truth"],
            "rejected": "x" + str(int(r["reward_model"]["ground_truth"]) + 1 + i % 3),
        }
        for i, r in enumerate(rows)
    ]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "model"
    tokenizer = build_tokenizer()
    return save_atomically(build_model(len(tokenizer), seed=0, hidden=64), tokenizer, path)


def rm_overrides(tmp_path: Path, model: Path, steps: int = 12) -> list[str]:
    write_parquet(_pairs(192, 0), tmp_path / "train.parquet", check_pair_row)
    write_parquet(_pairs(48, 1), tmp_path / "val.parquet", check_pair_row)
    return [
        "trainer.task=reward_model",
        f"model.path={model}",
        f"data.train_files=[{tmp_path / 'train.parquet'}]",
        f"data.val_files=[{tmp_path / 'val.parquet'}]",
        f"trainer.run_dir={tmp_path / 'run'}",
        "data.train_batch_size=16",
        "data.max_prompt_length=32",
        "reward_training.max_response_length=8",
        "reward_training.lr=1e-3",
        "reward_training.max_token_len_per_gpu=160",
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=6",
    ]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model) -> Path:
    from klppo_train.__main__ import main

    tmp = tmp_path_factory.mktemp("rm")
    assert main(rm_overrides(tmp, tiny_model)) == 0
    return tmp / "run"


def test_a_reward_model_learns_the_preference(trained) -> None:
    records = _records(trained)
    assert [r["step"] for r in records] == list(range(13))
    assert records[0]["val/rm/accuracy"] < 0.8 <= records[-1]["val/rm/accuracy"]
    assert records[-1]["rm/loss"] < records[1]["rm/loss"]
    for name in ("rm/loss", "rm/accuracy", "rm/margin", "rm/grad_norm", "val/rm/margin"):
        assert math.isfinite(records[-1][name]), name
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["final_val/rm/accuracy"] == records[-1]["val/rm/accuracy"]


def test_the_export_loads_with_transformers_and_scores_alike(trained) -> None:
    """``AutoModelForSequenceClassification`` reads the same token as klppo (the exported
    tokenizer pads with another token than EOS) and holds the held-out scores' mean/std."""
    from transformers import AutoModelForSequenceClassification

    from klppo_train.reward_model.training import PairBatch
    from klppo_train.runtime.hf_dirs import load_tokenizer

    path = trained / "reward_model_hf"
    hf = AutoModelForSequenceClassification.from_pretrained(path).eval()
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    assert config["num_labels"] == 1 and hf.score.bias is None
    tokenizer = load_tokenizer(path)
    assert tokenizer.pad_token_id != tokenizer.eos_token_id == 1
    rows = [check_pair_row(r, "r") for r in _pairs(6, 2)]
    batch = PairBatch.of(PairDataset(rows, tokenizer, 32, 8).pairs, tokenizer.pad_token_id)
    seqs = batch.sequences
    # transformers' own batch: the same sequences, right-padded with the exported pad token
    texts = [
        ids[m.bool()].tolist() for ids, m in zip(seqs.input_ids, seqs.attention_mask, strict=True)
    ]
    padded = tokenizer.pad({"input_ids": texts}, padding_side="right", return_tensors="pt")
    with torch.no_grad():
        theirs = hf(**padded).logits[:, 0]
        chosen, rejected = batch.scores(_rm_as_klppo_loads(path), max_tokens=10_000)
    torch.testing.assert_close(theirs, torch.stack([chosen, rejected], 1).flatten())
    val = _records(trained)[-1]
    assert config["mean"] == pytest.approx(val["val/rm/score_mean"])
    assert config["std"] == pytest.approx(val["val/rm/score_std"])


def _rm_as_klppo_loads(path: Path):
    from transformers import AutoModelForTokenClassification

    from klppo_train.reward_model.export import scalar_head_config

    model = AutoModelForTokenClassification.from_pretrained(path, config=scalar_head_config(path))
    model.set_attn_implementation(VARLEN)
    return model.eval()


def test_a_stopped_run_resumes_bit_identically(tmp_path, tiny_model, trained) -> None:
    from klppo_train.__main__ import main

    args = rm_overrides(tmp_path, tiny_model)
    assert main([*args, "trainer.stop_at_step=5", "trainer.save_freq=5"]) == 0
    assert main(args) == 0  # resumes at step 6
    a, b = _records(tmp_path / "run"), _records(trained)
    for x, y in zip(a, b, strict=True):
        assert {k: v for k, v in x.items() if not k.startswith("timing_s/")} == {
            k: v for k, v in y.items() if not k.startswith("timing_s/")
        }


# ------------------------------------------------------------------ in the PPO step


RM_ON = ("reward_model.enable=true", "reward_model.path=rm")


def test_reward_combinations_clip_and_missing_eos_penalty() -> None:
    ids = torch.tensor([[5, 1, 0], [5, 6, 7], [5, 9, 4]])  # EOS = 1; stop token 9; cut
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0]])
    t = Trajectories(ids, mask, mask, torch.zeros(3, 3), torch.arange(3))
    raw, rule = torch.tensor([3.0, 7.0, -30.0]), torch.tensor([1.0, 0.0, 1.0])

    def reward(**kwargs) -> list[float]:
        shaping = RewardModelReward(None, stop_ids=frozenset({1, 9}), **kwargs)
        return shaping.reward(raw, rule, t)[0].tolist()

    assert reward() == [3.0, 7.0, -10.0]  # clipped at ±10 by default
    assert reward(clip_range=0.0) == [3.0, 7.0, -30.0]
    assert reward(mean=1.0, std=2.0, clip_range=0.0) == [1.0, 3.0, -15.5]
    assert reward(missing_eos_penalty=0.5) == [3.0, 6.5, -10.0]  # row 3 stopped on 9
    assert reward(combine="rule") == [1.0, 0.0, 1.0]
    assert reward(combine="sum", rule_weight=2.0) == [5.0, 7.0, -8.0]
    metrics = RewardModelReward(None).reward(raw, rule, t)[1]
    assert metrics["reward_model/score/max"] == 7.0 and metrics["reward_model/score/min"] == -10


def test_the_step_scores_with_the_reward_model_and_combines() -> None:
    from klppo_train.ppo.step import ppo_step

    tokenizer = build_tokenizer()
    items = PromptDataset(make_arithmetic_rows(4, seed=0), tokenizer, DataConfig()).items
    for combine, rule_part in (("rm", 0.0), ("sum", 2.0), ("rule", None)):
        extra = (*RM_ON, f"reward_model.combine={combine}", "reward_model.rule_weight=2")
        _, c = components(tokenizer, extra)
        c.rewards.custom = lambda *row: 1.0  # every response right by the rule
        metrics = ppo_step(c, items, step=1)
        assert metrics["timing_s/reward_model"] > 0
        rm_part = metrics["reward_model/score/mean"]
        assert math.isfinite(rm_part) and metrics["reward_model/score/max"] > rm_part
        want = 1.0 if rule_part is None else rm_part + rule_part
        assert metrics["critic/score/mean"] == pytest.approx(want, abs=1e-5), combine


def test_reference_normalization_gives_its_samples_mean_0_std_1() -> None:
    tokenizer = build_tokenizer()
    normalized = ("reward_model.normalize=reference", "reward_model.normalize_samples=8")
    _, c = components(tokenizer, (*RM_ON, *normalized, "reward_model.clip_range=0"))
    items = PromptDataset(make_arithmetic_rows(8, seed=0), tokenizer, DataConfig()).items
    found = calibrate_reward_model(c, items)
    assert found["samples"] == 8 and found["std"] > 0
    # the same samples again (the same seeds), scored as the reward uses them
    mine, t, _ = c.rollouts.generate(items[:4], 0, range(4))
    score = c.reward_model.score(c.reward_model.scoring(t, c.budgets, 0, mine), t).double()
    assert float(score.mean()) == pytest.approx(0.0, abs=1e-5)
    assert float(score.std()) == pytest.approx(1.0, abs=1e-5)
    assert c.reward_model.state_dict()["mean"] == found["mean"]


def test_an_injected_oom_in_the_reward_model_pass_backs_off() -> None:
    tokenizer = build_tokenizer()
    _, c = components(tokenizer, RM_ON)
    gen = torch.Generator().manual_seed(0)
    ids, mask = prompt_response_batch([6, 3, 5, 6], [5, 2, 4, 1], P, T, VOCAB, generator=gen)
    t = Trajectories(ids, mask, mask[:, P:], torch.zeros(4, T), torch.arange(4))
    budgets = RunBudgets({"reward_model": 22}, minimum=11)
    FAULTS.reset("3:reward_model:1")
    try:
        scores = c.reward_model.scoring(t, budgets, 3)
    finally:
        FAULTS.reset("")
    assert budgets.tokens["reward_model"] == 11 and budgets.oom_retries == 1
    torch.testing.assert_close(scores, c.reward_model.scoring.compute(t, 11), rtol=0, atol=1e-6)


# ------------------------------------------------------------------ ensembles


def _stored(path: Path, mean: float, std: float) -> str:
    """A reward-model directory's config as far as the ensemble reads it: its stored
    mean/std (the tiny members themselves are built in memory by ``components``)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"mean": mean, "std": std}))
    return str(path)


def _ensemble(tmp_path: Path, reduce: str, *extra: str):
    a, b = _stored(tmp_path / "a", 0.5, 2.0), _stored(tmp_path / "b", -1.0, 0.25)
    keys = (f"reward_model.path={a}", f"reward_model.ensemble.paths=[{b}]")
    return components(
        build_tokenizer(),
        (*RM_ON, *keys, f"reward_model.ensemble.reduce={reduce}", *extra),
    )[1]


def test_an_ensemble_reduces_its_standardized_members(tmp_path) -> None:
    """Each member standardized by its own stored mean/std, then their minimum (or mean) is
    the score the reward and its metrics see; the probe measures one member."""
    gen = torch.Generator().manual_seed(0)
    ids, mask = prompt_response_batch([6, 3, 5, 6], [5, 2, 4, 1], P, T, VOCAB, generator=gen)
    t = Trajectories(ids, mask, mask[:, P:], torch.zeros(4, T), torch.arange(4))
    c = _ensemble(tmp_path, "min", "reward_model.clip_range=0")
    first, second = c.reward_model.scoring.members
    raw = c.reward_model.scoring(t, c.budgets, 1)
    want = torch.stack([(first.compute(t, 99) - 0.5) / 2.0, (second.compute(t, 99) + 1) / 0.25], 1)
    torch.testing.assert_close(raw, want, rtol=0, atol=1e-6)
    assert (raw[:, 0] != raw[:, 1]).all()  # two different models
    reward, metrics = c.reward_model.reward(raw, None, t)
    torch.testing.assert_close(reward, want.min(1).values, rtol=0, atol=0)
    assert metrics["reward_model/member1/score/mean"] == pytest.approx(float(want[:, 1].mean()))
    spread = float(want.std(1).mean())
    assert metrics["reward_model/ensemble/disagreement"] == pytest.approx(spread)
    assert c.pass_for("reward_model") is first
    mean = _ensemble(tmp_path, "mean", "reward_model.clip_range=0").reward_model
    torch.testing.assert_close(mean.reward(raw, None, t)[0], want.mean(1), rtol=0, atol=1e-6)
    # normalize=stored: the members are standardized already, nothing more is applied
    stored = _ensemble(tmp_path, "min", "reward_model.normalize=stored").reward_model
    assert (stored.mean, stored.std) == (0.0, 1.0)


def test_an_ensemble_in_the_step_and_in_the_reference_normalization(tmp_path) -> None:
    """The step rewards the members' minimum (below their mean); Ziegler's normalization
    applies to the reduced score."""
    from klppo_train.ppo.step import ppo_step

    tokenizer = build_tokenizer()
    items = PromptDataset(make_arithmetic_rows(8, seed=0), tokenizer, DataConfig()).items
    scores = {}
    for reduce in ("min", "mean"):
        c = _ensemble(tmp_path, reduce, "reward_model.clip_range=0")
        metrics = ppo_step(c, items[:4], step=1)
        scores[reduce] = metrics["reward_model/score/mean"]
        assert metrics["critic/score/mean"] == pytest.approx(scores[reduce], abs=1e-5)
        assert metrics["reward_model/ensemble/disagreement"] > 0
    assert scores["min"] < scores["mean"]
    normalized = ("reward_model.normalize=reference", "reward_model.normalize_samples=8")
    c = _ensemble(tmp_path, "min", *normalized, "reward_model.clip_range=0")
    calibrate_reward_model(c, items)
    mine, t, _ = c.rollouts.generate(items[:4], 0, range(4))
    score = c.reward_model.score(c.reward_model.scoring(t, c.budgets, 0, mine), t).double()
    assert float(score.mean()) == pytest.approx(0.0, abs=1e-5)
    assert float(score.std()) == pytest.approx(1.0, abs=1e-5)


# ------------------------------------------------------------------ re-templating


def _other_tokenizer():
    """A different tokenizer: the same characters at other ids (reversed), another chat
    template (its own turn markers)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {"<pad>": 0, "<end>": 1, "<unk>": 2}
    for char in reversed(chars):
        vocab[char] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<end>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    return tokenizer


WIDTH = 12  # the responses' width here


def test_retemplating_scores_what_the_reward_model_would_read_directly() -> None:
    policy, other = build_tokenizer(), _other_tokenizer()
    assert policy.get_vocab() != other.get_vocab()
    rm = _reward_model(len(other))
    rows = make_arithmetic_rows(3, seed=4)
    items = PromptDataset(rows, policy, DataConfig()).items
    answers = [("7", True), ("12 or 13", False), ("5", True)]  # the second was cut
    responses = [policy(a, add_special_tokens=False)["input_ids"] + [1] * e for a, e in answers]
    prompts = [list(i.prompt_ids) for i in items]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(3, width + WIDTH, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, width - len(p) : width + len(r)] = torch.tensor(p + r)
        mask[i, width - len(p) : width + len(r)] = 1
    t = Trajectories(ids, mask, mask[:, width:], torch.zeros(3, WIDTH), torch.arange(3))
    retemplate = Retemplate(policy, other, 512, WIDTH, frozenset({1}))
    rm_ids, rm_mask, width_rm = retemplate(t, items)
    with torch.no_grad():
        scores = response_scores(rm, rm_ids, rm_mask, width_rm, max_tokens=10_000)
    for i, (row, (answer, ended_)) in enumerate(zip(rows, answers, strict=True)):
        text = other.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        direct = other(text + answer, add_special_tokens=False)["input_ids"] + [1] * ended_
        assert scores[i].item() == pytest.approx(_direct_score(rm, torch.tensor(direct)), abs=1e-5)
