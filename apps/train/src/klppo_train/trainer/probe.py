"""``auto`` token budgets: each role's real pass, measured at a series of budgets before step 0.

For every role whose budget is ``auto`` (:data:`klppo_train.config.roles.ROLES`), the probe runs
that role's own pass as built for the run (:class:`Components`: the actor's and critic's
:class:`Trainee` forward + backward of their losses, gradients zeroed after, no optimizer
step; the old/ref log-prob :class:`ForwardPass`) on synthetic sequences of the recipe's full
length (``max_prompt_length + response_length``, random token ids), and lets
:func:`batching.search_budget` measure it at L, 4L, 16L, ... up to the most tokens that pass
ever gets in one micro-batch (one rank's mini-batch for updates, its whole batch for forward
passes) and choose. Each point records its time and its peak memory growth
(:mod:`klppo_train.trainer.measure`: CUDA ``max_memory_allocated``, CPU peak RSS).

The allowance is ``trainer.memory_limit_gib`` minus what is in use now and the optimizer
state still to come; 0 = 90 % of the GPU's free memory / 80 % of the available RAM, shared
by the ranks of a node. Memory grows quadratically with tokens for the dense-mask
attentions (sdpa, eager). A role's search costs about half of what its pass takes in one
step. The budgets never go below one sequence (L); when even that does not fit, the run
stops before step 0 naming the key. Under torchrun the ranks agree (each point's slowest
time and largest memory over the ranks), so they choose alike. The probe leaves the RNG and
the weights as they were.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batching import ProbePoint, search_budget
from fsdp_sharding import default_device
from klppo_train.budgets.run_budgets import AUTO, RunBudgets, resolve_budgets
from klppo_train.budgets.run_budgets import release_memory as release_cached
from klppo_train.config.errors import UserError
from klppo_train.config.roles import ROLES
from klppo_train.ppo.components import Components
from klppo_train.trainer.measure import PassMeter, agree, memory_allowance
from klppo_train.workers.passes import ForwardPass
from klppo_train.workers.trainee import Trainee
from klppo_train.workers.trajectories import Trajectories

log = logging.getLogger("klppo_train")
QUADRATIC_ATTENTION = ("sdpa", "eager")  # [nnz, nnz] masks: memory grows with tokens²


@dataclass(frozen=True)
class ProbeShape:
    """What the probe needs of the config, read once: the sequences' full length L
    (``max_prompt_length + response_length``), the response width T, the step's rows per
    rank and the trainees' epochs, the attention (dense masks grow with tokens²), the
    memory limit and whether the engine keeps its weights asleep (then it sleeps while the
    passes are measured, as in a step). ``unit_rows``: the sequences the smallest
    micro-batch holds (2 for a reward model's preference pair)."""

    sequence: int
    response: int
    step_rows: int
    quadratic: bool = False
    memory_limit_gib: float = 0.0
    engine_sleeps: bool = True
    unit_rows: int = 1

    @property
    def minimum(self) -> int:
        """The smallest budget: one unit (sequence or pair) of full length."""
        return self.sequence * self.unit_rows

    def cap(self, role_pass: ForwardPass | Trainee) -> int:
        """The most tokens one micro-batch of the pass can hold: a rank's mini-batch
        (updates) or its whole batch (forward passes), of full-length sequences."""
        rows = getattr(role_pass, "rows_per_mini_batch", self.step_rows)
        return max(rows, 1) * self.sequence

    def step_tokens(self, role_pass: ForwardPass | Trainee) -> int:
        """Tokens the pass handles in one step on one rank (full-length sequences)."""
        return self.step_rows * self.sequence * getattr(role_pass, "epochs", 1)


def synthetic(shape: ProbeShape, rows: int, vocab: int, seed: int) -> Trajectories:
    """``rows`` full-length sequences in verl's layout, random ids, all-ones masks; the
    losses' inputs (advantages random, old/ref/engine log-probs and values zero, returns 1)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (rows, shape.sequence), generator=generator)
    device = default_device()
    response = torch.ones(rows, shape.response, dtype=torch.long, device=device)
    advantages = torch.randn(response.shape, generator=torch.Generator().manual_seed(0))
    zeros = torch.zeros(response.shape, device=device)
    return Trajectories(
        input_ids=ids.to(device),
        attention_mask=torch.ones_like(ids).to(device),
        response_mask=response,
        engine_logprobs=zeros,
        prompt_index=torch.arange(rows, device=device),
        ref_logprobs=zeros,
        values=zeros,
        advantages=advantages.to(device),
        returns=zeros + 1,
    )


def run_pass(role_pass: ForwardPass | Trainee) -> Callable[[Trajectories, int], None]:
    """``run(batch, budget)``: one pass at ``budget`` (an update's forward + backward, its
    gradients zeroed after; synthetic prompts all differ: nothing is shared)."""
    if isinstance(role_pass, ForwardPass):
        return lambda batch, budget: role_pass.compute(batch, budget)

    def update(batch: Trajectories, budget: int) -> None:
        role_pass.accumulate(batch, budget)
        role_pass.optimizer.zero_grad(set_to_none=True)

    return update


def role_measure(
    role_pass: ForwardPass | Trainee, shape: ProbeShape, vocab: int
) -> Callable[[int], ProbePoint]:
    """``measure(budget)``: one timed pass on a synthetic batch of ``budget`` tokens, its
    memory over the base :class:`PassMeter` took after a warm-up pass (first calls set up
    kernels), agreed over the ranks."""
    run = run_pass(role_pass)
    run(synthetic(shape, shape.unit_rows, vocab, seed=0), shape.minimum)
    meter = PassMeter()

    def measure(budget: int) -> ProbePoint:
        batch = synthetic(shape, budget // shape.sequence, vocab, seed=budget)
        return agree(meter(lambda: run(batch, budget), budget))

    return measure


def probe_role(
    role_pass: ForwardPass | Trainee, shape: ProbeShape, vocab: int, allowance: float
) -> dict:
    """Measure the pass over the budget series; its choice, fit and points."""
    start = time.perf_counter()
    found = search_budget(
        role_measure(role_pass, shape, vocab),
        minimum=shape.minimum,
        cap=shape.cap(role_pass),
        allowance=allowance,
        step_tokens=shape.step_tokens(role_pass),
        cpu=default_device().type == "cpu",
        quadratic=shape.quadratic,
    )
    return {**found, "seconds": time.perf_counter() - start}


def _too_small(role: str, shape: ProbeShape, found: dict, memory: dict) -> UserError:
    need = found["points"][0]["memory_gib"]
    return UserError(
        f"{ROLES[role].budget_key}=auto: {shape.unit_rows} sequence(s) of {shape.sequence} "
        "tokens need "
        f"{need:.2f} GiB, more than the {memory['allowance_gib']:.2f} GiB left under "
        f"trainer.memory_limit_gib={shape.memory_limit_gib:g} ({memory['limit_gib']:.2f} "
        f"GiB, {memory['in_use_gib']:.2f} in use, {memory['optimizer_state_gib']:.2f} for "
        "the optimizer state): raise the limit or shorten the sequences"
    )


def choose_budgets(
    c: Components, configured: dict[str, int | str], shape: ProbeShape, path=None
) -> RunBudgets:
    """The run's budgets: the configured numbers (``configured``: each role's value), and
    for ``auto`` ones the probe's choice (printed as a table; all of it in ``budgets.json``
    at ``path``)."""
    auto = [role for role, value in configured.items() if value == AUTO]
    probe = _probe(c, shape, auto) if auto else None
    probed = {}
    for role in auto:
        found = probe["roles"][role]  # None: the pass does not run; any valid value will do
        probed[role] = (
            (found["chosen"], "auto") if found else (3 * shape.sequence, "auto (pass not run)")
        )
    budgets = resolve_budgets(configured, shape.minimum, path, probed)
    budgets.probe = probe
    budgets.write()
    return budgets


def _probe(c: Components, shape: ProbeShape, roles: list[str]) -> dict:
    # As in a step, the engine sleeps while the passes run (on CUDA it frees its KV cache),
    # unless its sleep drops the weights (vLLM level 2: only a weight sync brings them
    # back); awake, the allowance is smaller than the step's, never larger.
    if shape.engine_sleeps:
        c.engine.sleep()
    try:
        return _probe_roles(c, shape, roles)
    finally:
        if shape.engine_sleeps:
            c.engine.wake_up()


def _probe_roles(c: Components, shape: ProbeShape, roles: list[str]) -> dict:
    start = time.perf_counter()
    allowance, memory = memory_allowance(shape.memory_limit_gib, c)
    found: dict[str, dict | None] = {}
    cuda = default_device().type == "cuda"
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        for role in roles:
            role_pass = c.pass_for(role)
            if role_pass is None:  # the role's pass does not run in this configuration
                found[role] = None
                continue
            found[role] = probe_role(role_pass, shape, len(c.tokenizer), allowance)
            if not found[role]["chosen"]:
                raise _too_small(role, shape, found[role], memory)
    release_cached()
    probe = {"memory": memory, "roles": found, "seconds": time.perf_counter() - start}
    log_probe(probe)
    return probe


def log_probe(probe: dict) -> None:
    memory = probe["memory"]
    log.info(
        "token budgets (auto): %.1f s of probing; a pass may add %.2f GiB (limit %.2f, in "
        "use %.2f, optimizer state %.2f, %d rank(s) sharing)",
        probe["seconds"], memory["allowance_gib"], memory["limit_gib"], memory["in_use_gib"],
        memory["optimizer_state_gib"], memory["ranks_sharing"],
    )  # fmt: skip
    for role, found in probe["roles"].items():
        if found is None:
            log.info("  %s=auto: its pass does not run here", ROLES[role].budget_key)
            continue
        fit = " + ".join(f"{coef:.3g}·t^{k}" for k, coef in enumerate(found["fit_gib"]))
        log.info(
            "  %s=auto -> %d (memory ≈ %s GiB; %.1f s)",
            ROLES[role].budget_key, found["chosen"], fit, found["seconds"],
        )  # fmt: skip
        log.info("    %8s %10s %9s", "tokens", "tokens/s", "+GiB")
        for p in found["points"]:
            mark = "  <- chosen" if p["budget"] == found["chosen"] else ""
            rate = p["budget"] / p["seconds"]
            log.info("    %8d %10.0f %9.3f%s", p["budget"], rate, p["memory_gib"], mark)
