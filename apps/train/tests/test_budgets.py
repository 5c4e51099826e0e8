"""Token budgets: the OOM back-off (through the fault hook, in real passes), the config's
``auto``, and the probe's measuring and choosing (a real tiny model)."""

import copy

import pytest
import torch
from test_step import OVERRIDES, components
from train_testing import prompt_response_batch

from klppo_train.budgets.faults import FAULTS, parse_faults
from klppo_train.budgets.run_budgets import RunBudgets, budgets_from_config, run_with_backoff
from klppo_train.checks.validate import validate_config
from klppo_train.config.errors import UserError
from klppo_train.config.roles import ROLES, task_roles
from klppo_train.config.schema import load_config
from klppo_train.demo.embedded import build_model, build_tokenizer
from klppo_train.ppo.losses import PolicyLoss
from klppo_train.trainer.assemble import StepBuilder
from klppo_train.trainer.probe import choose_budgets
from klppo_train.workers.forward import response_logprobs
from klppo_train.workers.passes import Pass
from klppo_train.workers.trainee import Trainee
from klppo_train.workers.trajectories import Trajectories

P, T, VOCAB = 6, 4, 64
ROWS = 8  # sequences of P + T = 10 tokens at most
VANILLA = (("clip_ratio_low", 0.2), ("clip_ratio_high", 0.2), ("clip_ratio_c", 3.0))


@pytest.fixture(autouse=True)
def no_faults():
    FAULTS.reset("")
    yield
    FAULTS.reset("")


def batch():
    gen = torch.Generator().manual_seed(0)
    lens = [6, 3, 5, 6, 2, 6, 4, 6]
    return prompt_response_batch(lens, [4, 2, 4, 1, 3, 4, 4, 2], P, T, VOCAB, generator=gen)


def budgets(actor=40, rollout=40, minimum=10) -> RunBudgets:
    tokens = {"actor": actor, "critic": 40, "ref": 40, "rollout": rollout}
    return RunBudgets(tokens, minimum)


def test_fault_specs_are_checked() -> None:
    found = parse_faults("2:ref:0, 3:update_actor:5@1")
    assert found == {(2, "ref", 0): None, (3, "update_actor", 5): 1}  # rank 1 only
    assert parse_faults("") == {}
    for bad in ("2:ref", "x:ref:0", "2:refs:0", "2:ref:-1", "2:ref:0@", "2:ref:0@x"):
        with pytest.raises(ValueError, match="KLPPO_FAULT_OOM"):
            parse_faults(bad)


def test_forward_pass_backs_off_and_equals_the_smaller_budget() -> None:
    model = build_model(VOCAB, seed=0, hidden=64)
    ids, mask = batch()
    state = budgets(rollout=40)

    def run(budget: int) -> torch.Tensor:
        with torch.no_grad():
            return response_logprobs(model, ids, mask, T, max_tokens=budget)[0]

    FAULTS.reset("3:old_log_prob:1")  # the second micro-batch of step 3's pass
    assert torch.equal(run_with_backoff(state, "old_log_prob", 2, run), run(40))  # not due
    backed_off = run_with_backoff(state, "old_log_prob", 3, run)
    assert state.tokens["rollout"] == 20 and state.oom_retries == 1 and FAULTS.raised == 1
    torch.testing.assert_close(backed_off, run(20), rtol=0, atol=1e-6)
    assert [(b.step, b.pass_name, b.old, b.new) for b in state.backoffs] == [
        (3, "old_log_prob", 40, 20)
    ]


def test_update_backs_off_with_exactly_one_optimizer_step() -> None:
    ids, mask = batch()
    gen = torch.Generator().manual_seed(1)
    policy = Trajectories(
        input_ids=ids, attention_mask=mask, response_mask=mask[:, P:],
        engine_logprobs=torch.zeros(ROWS, T), prompt_index=torch.arange(ROWS),
        old_logprobs=torch.randn(ROWS, T, generator=gen) - 2,
        advantages=torch.randn(ROWS, T, generator=gen),
    )  # fmt: skip
    loss = PolicyLoss(
        loss_mode="vanilla", hyperparameters=VANILLA, policy_agg_mode="token-mean",
        loss_agg_mode="token-mean",
        entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="low_var_kl",
    )  # fmt: skip

    def train(budget_state: RunBudgets, step: int):
        model = build_model(VOCAB, seed=0, hidden=64)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        actor = Trainee(
            name="actor", model=model, optimizer=optimizer, loss=loss,
            update=Pass(name="update_actor"), epochs=1, rows_per_mini_batch=ROWS,
        )  # fmt: skip
        actor.train(policy, budget_state, step)  # one mini-batch: one optimizer step
        return model, optimizer

    FAULTS.reset("1:update_actor:1")  # after the first micro-batch's backward
    injected, optimizer = train(budgets(actor=40), step=1)
    assert FAULTS.raised == 1
    assert all(int(s["step"]) == 1 for s in optimizer.state.values())  # one step, not two
    direct, _ = train(budgets(actor=20), step=1)
    for a, b in zip(injected.parameters(), direct.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_back_off_stops_at_one_sequence_and_names_the_key() -> None:
    state = budgets(actor=24, minimum=10)
    assert state.back_off("update_actor", 1, "oom") == 12
    assert state.back_off("update_actor", 1, "oom") == 10  # never below the minimum
    with pytest.raises(torch.OutOfMemoryError, match="actor.ppo_max_token_len_per_gpu=10"):
        state.back_off("update_actor", 1, "oom")


def test_fixed_micro_batch_sizes_let_the_error_through() -> None:
    state = budgets()

    def run(budget: int):
        raise torch.OutOfMemoryError("real")

    with pytest.raises(torch.OutOfMemoryError, match="real"):
        run_with_backoff(state, "ref", 1, run, dynamic=False)
    assert state.oom_retries == 0


def test_budgets_json_is_written_on_every_change(tmp_path) -> None:
    import json

    state = budgets()
    state.path = tmp_path / "budgets.json"
    state.write()
    assert json.loads(state.path.read_text())["tokens"]["actor"] == 40
    state.back_off("update_actor", 2, "oom")
    saved = json.loads(state.path.read_text())
    assert saved["tokens"]["actor"] == 20 and len(saved["backoffs"]) == 1
    again = RunBudgets.from_state(saved)
    assert again.tokens == state.tokens and again.backoffs == state.backoffs
    assert not list(tmp_path.glob("*.tmp"))


def test_a_checkpoint_keeps_its_budgets_only_at_its_own_world_size() -> None:
    """Per-rank budgets saved at world size 2 are not taken by a run at 1 (it chooses them
    again); saved at 1 (this process), they are, halvings and all."""
    from types import SimpleNamespace

    from klppo_train.loop.checkpoints import BudgetsInForce

    state = budgets()
    state.back_off("update_actor", 2, "oom")
    saved = BudgetsInForce(SimpleNamespace(budgets=state)).state_dict()
    assert saved["world_size"] == 1
    same = SimpleNamespace(budgets=None)
    BudgetsInForce(same).load_state_dict(saved)
    assert same.budgets.tokens == state.tokens and same.budgets.backoffs == state.backoffs
    other = SimpleNamespace(budgets=None)
    BudgetsInForce(other).load_state_dict({**saved, "world_size": 2})
    assert other.budgets is None  # chosen again from the config


# ----------------------------------------------------------------- config and auto


WITH_RM = ("reward_model.enable=true", "reward_model.path=rm")  # checked by preflight only


def test_auto_is_a_budget_value_and_nothing_else_is() -> None:
    auto = [f"{ROLES[role].budget_key}=auto" for role in task_roles("ppo")]
    cfg = load_config(None, [*OVERRIDES, *auto, *WITH_RM])
    validate_config(cfg)
    with pytest.raises(ValueError, match="auto"):
        budgets_from_config(cfg)
    bad = [
        ("actor.ppo_max_token_len_per_gpu=lots", "actor.ppo_max_token_len_per_gpu='lots'"),
        ("critic.ppo_max_token_len_per_gpu=0", "critic.ppo_max_token_len_per_gpu must be >= 1"),
        ("trainer.memory_limit_gib=-1", "trainer.memory_limit_gib must be >= 0"),
    ]
    for override, message in bad:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            validate_config(load_config(None, [*OVERRIDES, override]))
    static = ["actor.use_dynamic_bsz=false", "actor.ppo_max_token_len_per_gpu=auto"]
    with pytest.raises(ValueError, match="auto with actor.use_dynamic_bsz=false"):
        validate_config(load_config(None, [*OVERRIDES, *static]))


def test_auto_probes_real_passes_and_leaves_the_run_as_it_was(tmp_path) -> None:
    tokenizer = build_tokenizer()
    roles = task_roles("ppo")  # the reward model's among them
    auto = tuple(f"{ROLES[role].budget_key}=auto" for role in roles)
    cfg, c = components(tokenizer, (*auto, *WITH_RM))
    weights = copy.deepcopy(c.actor.model.state_dict())
    rng = torch.get_rng_state()
    builder = StepBuilder(cfg)
    chosen = choose_budgets(
        c, builder.configured_budgets(), builder.probe_shape(), tmp_path / "budgets.json"
    )
    minimum = cfg.data.max_prompt_length + cfg.rollout.sampling.max_new_tokens
    assert set(chosen.tokens) == set(roles) and min(chosen.tokens.values()) >= minimum
    assert chosen.source == {role: "auto" for role in roles}
    for role in roles:
        found = chosen.probe["roles"][role]
        measured = [p["budget"] for p in found["points"]]
        assert measured[0] == minimum and measured == sorted(measured)
        # a measured budget, or (still rising when the probe stopped) the fit's, up to the cap
        assert chosen.tokens[role] in measured or measured[-1] < chosen.tokens[role] <= found["cap"]
        assert all(p["seconds"] > 0 and p["memory_gib"] >= 0 for p in found["points"])
    # actor: 2 prompts × 2 samples per mini-batch; old/ref log-probs: all 8 samples
    assert chosen.probe["roles"]["actor"]["cap"] == 4 * minimum
    assert chosen.probe["roles"]["ref"]["cap"] == 8 * minimum
    assert chosen.probe["roles"]["reward_model"]["cap"] == 8 * minimum
    assert (tmp_path / "budgets.json").is_file()
    assert torch.equal(torch.get_rng_state(), rng)
    for name, value in c.actor.model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    assert all(p.grad is None for p in c.actor.model.parameters())
    assert all(p.grad is None for p in c.critic.model.parameters())
    assert all(p.grad is None for p in c.reward_model.scoring.model.parameters())


def test_a_memory_limit_that_one_sequence_cannot_meet_fails_naming_the_key() -> None:
    tokenizer = build_tokenizer()
    limited = ("actor.ppo_max_token_len_per_gpu=auto", "trainer.memory_limit_gib=0.5")
    cfg, c = components(tokenizer, limited)
    with pytest.raises(UserError, match="actor.ppo_max_token_len_per_gpu=auto.*memory_limit"):
        choose_budgets(c, StepBuilder(cfg).configured_budgets(), StepBuilder(cfg).probe_shape())


# ------------------------------------------------------------------ whole runs

# The embedded default at test size (test_run.overrides): 8 prompts × 4 samples of ≤ 28
# tokens. One fault per pass; where the back-off ends: actor 512 → 256, critic 1024 → 512
# → 256, ref 1024 → 512, rollout 8192 → 4096.
FAULTS_SPEC = "2:update_actor:1,3:ref:0,4:values:0,5:old_log_prob:0,5:update_critic:0"
BACKED_OFF = {
    "actor.ppo_max_token_len_per_gpu": 256,
    "critic.ppo_max_token_len_per_gpu": 256,
    "ref.log_prob_max_token_len_per_gpu": 512,
    "rollout.log_prob_max_token_len_per_gpu": 4096,
}


@pytest.mark.slow  # three short runs of the embedded default (HF engine)
def test_injected_ooms_give_the_run_of_the_backed_off_budgets(tmp_path, monkeypatch) -> None:
    """Faults in every pass, with a stop and a resume in between: every step runs, each
    fault is one retry, the halved budgets survive the resume (from the checkpoint, no
    probe), and the metrics equal a run that had the backed-off budgets from the start."""
    import json
    import math

    from test_run import overrides, read_records

    from klppo_train.__main__ import main

    injected, direct = tmp_path / "injected", tmp_path / "direct"
    common = ["trainer.save_freq=3", "trainer.test_freq=3"]
    start = [*overrides(injected, steps=6), *common, "rollout.log_prob_max_token_len_per_gpu=8192"]
    monkeypatch.setenv("KLPPO_FAULT_OOM", FAULTS_SPEC)
    assert main([*start, "trainer.stop_at_step=3"]) == 0
    assert main(start) == 0  # resumes at step 4
    monkeypatch.delenv("KLPPO_FAULT_OOM")
    assert (
        main([*overrides(direct, steps=6), *common, *(f"{k}={v}" for k, v in BACKED_OFF.items())])
        == 0
    )
    saved = json.loads((injected / "budgets.json").read_text())
    assert {ROLES[role].budget_key: n for role, n in saved["tokens"].items()} == BACKED_OFF
    assert len(saved["backoffs"]) == 5
    assert set(saved["source"].values()) == {"checkpoint"}  # the resumed run's
    a, b = read_records(injected), read_records(direct)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(7))
    assert sum(r.get("perf/oom_retries", 0) for r in a) == 5
    assert [r["perf/token_budget/actor"] for r in a[1:]] == [512, 256, 256, 256, 256, 256]
    for x, y in zip(a, b, strict=True):
        for key in x:
            if key.startswith(("timing_s/", "perf/")):
                continue
            assert math.isclose(x[key], y[key], rel_tol=1e-5, abs_tol=1e-5), (x["step"], key)


@pytest.mark.slow  # builds the embedded model (short warm-up) before the probe can fail
def test_an_unmeetable_memory_limit_stops_the_run_before_step_0(tmp_path, capsys) -> None:
    from test_run import overrides

    from klppo_train.__main__ import main

    run = tmp_path / "run"
    args = [*overrides(run), "actor.ppo_max_token_len_per_gpu=auto", "trainer.memory_limit_gib=0.5"]
    assert main(args) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("klppo-train: error: ") and "Traceback" not in err, err[-3000:]
    assert "actor.ppo_max_token_len_per_gpu=auto" in last
    assert "trainer.memory_limit_gib=0.5" in last
    assert not (run / "metrics.jsonl").exists()  # no step ran, not even validation
