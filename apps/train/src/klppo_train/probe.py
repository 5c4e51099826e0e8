"""``auto`` token budgets: each role's real pass, measured at a series of budgets before step 0.

For every role whose budget is ``auto`` (:mod:`klppo_train.budgets`), the probe runs that
role's own pass -- the actor's and critic's forward + backward of their losses (gradients
zeroed after: no optimizer step), the old/ref log-prob forwards -- on synthetic sequences
of the recipe's full length (``max_prompt_length + response_length``, random token ids) at
budgets L, 4L, 16L, ... up to the most tokens that pass ever gets in one micro-batch (one
rank's mini-batch for updates, its whole batch for forward passes). Each point records its
time and its peak memory growth (:mod:`klppo_train.measure`: CUDA ``max_memory_allocated``,
CPU peak RSS).

Memory is fitted as ``a + b·tokens`` (``+ c·tokens²`` for the dense-mask attentions, sdpa and
eager). The choice per role is the largest budget whose memory stays within the allowance
-- ``trainer.memory_limit_gib`` minus what is in use now and the optimizer state still to
come; 0 = 90 % of the GPU's free memory / 80 % of the available RAM, shared by the ranks of a
node -- and, on CPU, not past the point where tokens/s stops improving by 5 %. A role's
series stops where measuring the next budget would make its probing cost more than half of
what its pass takes in one step (so the whole probe costs about half a step; the larger
budgets are the costly ones, which is why the series grows by 4x, not 2x). When tokens/s
was still rising there, the choice goes on past the largest point measured up to the cap,
for as long as memory scaled from that point -- proportionally (quadratically for the dense
masks), never less than the fit -- stays within the allowance. Why not the fit alone: a
peak is the larger of a constant (gradients, gathered parameters) and what grows with the
tokens, so small budgets hide the growth (SmolLM2's actor update on CPU: +1.47 GiB at 1408
tokens, fit 3.3 GiB at 5632, measured 5.3); scaling from a point bounds both shapes from
above (``max(a, b·t)`` and ``a + b·t``, ``a, b ≥ 0``). The budgets never go below one
sequence (L); when even that does not fit, the run stops before step 0 naming the key.
Under torchrun the ranks agree (each point's slowest time and largest memory over the
ranks), so they choose alike. The probe leaves the RNG and the weights as they were.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from fsdp_sharding import default_device
from klppo_train.actor import PolicyBatch, actor_micro_loss
from klppo_train.budgets import (
    AUTO,
    KEYS,
    RunBudgets,
    budgets_from_config,
    configured,
    longest_sequence,
)
from klppo_train.budgets import release_memory as release_cached
from klppo_train.components import Components
from klppo_train.config import AppConfig
from klppo_train.critic import ValueBatch, critic_micro_loss
from klppo_train.distributed import world_size
from klppo_train.measure import PassMeter, ProbePoint, agree, memory_allowance
from klppo_train.step import no_grad_logprobs, skips_old_log_prob_pass
from klppo_train.update import accumulate_gradients

log = logging.getLogger("klppo_train")
MIN_GAIN = 1.05  # CPU: a larger budget must raise tokens/s by 5 % to be worth its memory
GROWTH = 4  # budgets L, 4L, 16L, ...: the points that cost are the large ones
COST_SHARE = 0.5  # a role's probe may cost this share of its pass's time in one step
QUADRATIC_ATTENTION = ("sdpa", "eager")  # [nnz, nnz] masks: memory grows with tokens²


@dataclass(frozen=True)
class SyntheticBatch:
    """verl's layout of ``rows`` full-length sequences (``[rows, P + T]``, ``[rows, T]``)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor

    @classmethod
    def make(cls, cfg: AppConfig, rows: int, vocab: int, seed: int) -> SyntheticBatch:
        total = longest_sequence(cfg)
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(vocab, (rows, total), generator=generator)
        device = default_device()
        response = torch.ones(rows, cfg.rollout.sampling.max_new_tokens, dtype=torch.long)
        return cls(ids.to(device), torch.ones_like(ids).to(device), response.to(device))


def role_pass(c: Components, cfg: AppConfig, role: str) -> Callable[[SyntheticBatch, int], None]:
    """``run(batch, budget)``: the role's most demanding pass at ``budget``."""

    def update(model, optimizer, loss, batch, budget: int) -> None:
        # The step's own packing (synthetic prompts all differ: nothing is shared).
        share = cfg.model.share_prompts
        accumulate_gradients(
            model, batch, loss, max_tokens=budget, prefix=role, share_prompts=share
        )
        optimizer.zero_grad(set_to_none=True)

    def actor(b: SyntheticBatch, budget: int) -> None:
        shape = b.response_mask.shape
        advantages = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        zeros = torch.zeros(shape, device=b.input_ids.device)
        batch = PolicyBatch(
            b.input_ids, b.attention_mask, b.response_mask, None,
            advantages.to(zeros.device), ref_logprobs=zeros, engine_logprobs=zeros,
        )  # fmt: skip
        temperature = cfg.rollout.sampling.temperature
        loss = actor_micro_loss(cfg.actor, temperature, cfg.model.share_prompts)
        update(c.actor, c.actor_optimizer, loss, batch, budget)

    def critic(b: SyntheticBatch, budget: int) -> None:
        zeros = torch.zeros(b.response_mask.shape, device=b.input_ids.device)
        batch = ValueBatch(b.input_ids, b.attention_mask, b.response_mask, zeros, zeros + 1)
        loss = critic_micro_loss(cfg.critic, cfg.model.share_prompts)
        update(c.critic, c.critic_optimizer, loss, batch, budget)

    def forward(model, section, entropy: bool):
        def run(b: SyntheticBatch, budget: int) -> None:
            no_grad_logprobs(model, b, cfg, section, budget, with_entropy=entropy)

        return run

    passes = {
        "actor": actor,
        "critic": critic,
        "rollout": forward(c.actor, cfg.rollout, True),
        "ref": forward(c.ref, cfg.ref, False),
    }
    return passes[role]


def cap_tokens(cfg: AppConfig, role: str) -> int:
    """The most tokens one micro-batch of the role's pass can hold: a rank's mini-batch
    (updates) or its whole batch (forward passes), of full-length sequences."""
    prompts = {
        "actor": cfg.actor.ppo_mini_batch_size,
        "critic": cfg.critic.ppo_mini_batch_size,
    }.get(role, cfg.data.train_batch_size)
    rows = max(prompts * cfg.rollout.sampling.n // world_size(), 1)
    return rows * longest_sequence(cfg)


def series(minimum: int, cap: int, growth: int = GROWTH) -> list[int]:
    """``minimum · growth^k`` below ``cap``, then ``cap`` itself."""
    budgets = [minimum]
    while budgets[-1] * growth < cap:
        budgets.append(budgets[-1] * growth)
    return budgets + ([cap] if cap > budgets[-1] else [])


# ---------------------------------------------------------------------- choosing


def fit_memory(points: list[ProbePoint], quadratic: bool) -> list[float]:
    """Least-squares coefficients ``[a, b(, c)]`` of memory_gib ≈ a + b·t (+ c·t²)."""
    degree = min(2 if quadratic else 1, len(points) - 1)
    tokens = torch.tensor([p.budget for p in points], dtype=torch.float64)
    memory = torch.tensor([[p.memory_gib] for p in points], dtype=torch.float64)
    if degree < 1:
        return [float(memory[0, 0]), 0.0]
    powers = torch.stack([tokens**k for k in range(degree + 1)], dim=1)
    return torch.linalg.lstsq(powers, memory).solution[:, 0].tolist()


def predicted_gib(coefficients: list[float], tokens: float) -> float:
    return float(sum(coef * tokens**k for k, coef in enumerate(coefficients)))


def best_rate(points: list[ProbePoint]) -> tuple[ProbePoint, int]:
    """The largest budget that raised tokens/s by ``MIN_GAIN`` over every smaller one, and
    how many larger budgets measured after it did not (its misses)."""
    best, misses = points[0], 0
    for point in points[1:]:
        if point.tokens_per_s >= MIN_GAIN * best.tokens_per_s:
            best, misses = point, 0
        else:
            misses += 1
    return best, misses


def knee(points: list[ProbePoint]) -> ProbePoint | None:
    """The point after which tokens/s stopped rising: the next two budgets both gained less
    than ``MIN_GAIN`` over it (one alone can be a slow measurement: an interrupt, a burst
    of page faults). None until then."""
    best, misses = best_rate(points)
    return best if misses >= 2 else None


def choose(
    points: list[ProbePoint],
    fit: list[float],
    allowance: float,
    cap: int,
    cpu: bool,
    quadratic: bool = False,
) -> int:
    """The largest budget within the allowance; on CPU the best tokens/s (:func:`best_rate`).
    Where the largest point measured fits (and, on CPU, still raised tokens/s), the choice
    goes on past it up to ``cap`` while that point's memory, scaled by tokens (tokens² when
    ``quadratic``) and never below the fit, stays within the allowance."""
    fitting = [p for p in points if p.memory_gib <= allowance]
    if not fitting:
        return 0
    best, misses = best_rate(fitting) if cpu else (fitting[-1], 0)
    if misses or best.budget != points[-1].budget or best.budget >= cap:
        return best.budget
    power = 2 if quadratic else 1

    def bound(tokens: int) -> float:  # an upper bound for a + b·t (+ c·t²), a, b, c ≥ 0
        scaled = best.memory_gib * (tokens / best.budget) ** power
        return max(scaled, predicted_gib(fit, tokens))

    low, high = best.budget, cap + 1  # low is allowed; high is past what may be chosen
    while high - low > 1:  # binary search
        middle = (low + high) // 2
        low, high = (middle, high) if bound(middle) <= allowance else (low, middle)
    return low


# ------------------------------------------------------------------------- probing


def _unused(c: Components, cfg: AppConfig, role: str) -> bool:
    """Roles whose passes do not run in this configuration (nothing to measure)."""
    return {
        "critic": c.critic is None,
        "ref": c.ref is None,
        "rollout": skips_old_log_prob_pass(cfg),
    }.get(role, False)


def role_measure(c: Components, cfg: AppConfig, role: str) -> Callable[[int], ProbePoint]:
    """``measure(budget)``: one timed pass of the role on a synthetic batch of ``budget``
    tokens, its memory over the base :class:`PassMeter` took after a warm-up pass (first
    calls set up kernels), agreed over the ranks."""
    run, minimum, vocab = role_pass(c, cfg, role), longest_sequence(cfg), len(c.tokenizer)
    run(SyntheticBatch.make(cfg, 1, vocab, seed=0), minimum)
    meter = PassMeter()

    def measure(budget: int) -> ProbePoint:
        batch = SyntheticBatch.make(cfg, budget // minimum, vocab, seed=budget)
        return agree(meter(lambda: run(batch, budget), budget))

    return measure


def probe_role(c: Components, cfg: AppConfig, role: str, allowance: float) -> dict:
    """Measure ``role``'s pass over the budget series; its choice, fit and points."""
    start = time.perf_counter()
    minimum, cap, cpu = longest_sequence(cfg), cap_tokens(cfg, role), default_device().type == "cpu"
    measure = role_measure(c, cfg, role)
    points: list[ProbePoint] = []
    budgets = series(minimum, cap)
    for k, budget in enumerate(budgets):
        points.append(measure(budget))
        if points[-1].memory_gib > allowance:
            break
        if cpu and knee(points) is not None:
            break  # tokens/s stopped rising by MIN_GAIN: larger budgets are not worth it
        if k + 1 < len(budgets) and _over_cost(points, budgets[k + 1], step_tokens(cfg, role)):
            break
    if cpu:
        points = confirm_last_miss(points, allowance, measure)
    quadratic = cfg.model.attn_implementation in QUADRATIC_ATTENTION
    fit = fit_memory(points, quadratic)
    chosen = choose(points, fit, allowance, cap, cpu, quadratic)
    return {
        "chosen": chosen,
        "fit_gib": fit,
        "cap": cap,
        "points": [asdict(p) for p in points],
        "seconds": time.perf_counter() - start,
    }


def confirm_last_miss(
    points: list[ProbePoint], allowance: float, measure: Callable[[int], ProbePoint]
) -> list[ProbePoint]:
    """Where the series ended on one miss (the choice would rest on a single slow
    measurement), the best point and that last one are measured once more and keep their
    faster time: on a shared machine noise only slows a pass down. Memory stays the first
    measurement's (made in increasing order; a smaller pass measured after a larger one
    would see the larger one's memory still cached)."""
    fitting = [p for p in points if p.memory_gib <= allowance]
    if len(fitting) < 2 or fitting[-1] is not points[-1]:
        return points
    best, misses = best_rate(fitting)
    if misses != 1:
        return points
    again = {best.budget, points[-1].budget}
    return [
        replace(p, seconds=min(p.seconds, measure(p.budget).seconds)) if p.budget in again else p
        for p in points
    ]


def step_tokens(cfg: AppConfig, role: str) -> int:
    """Tokens the role's pass handles in one step on one rank (full-length sequences)."""
    rows = cfg.data.train_batch_size * cfg.rollout.sampling.n // world_size()
    epochs = {"actor": cfg.actor.ppo_epochs, "critic": cfg.critic.ppo_epochs}.get(role, 1)
    return rows * longest_sequence(cfg) * epochs


def _over_cost(points: list[ProbePoint], next_budget: int, per_step: int) -> bool:
    """Whether measuring ``next_budget`` too would make the role's probe cost more than
    ``COST_SHARE`` of what the role's pass takes in one step (at the best tokens/s seen):
    the probe as a whole then costs about half a step, a twentieth of the first ten."""
    spent = sum(p.seconds for p in points)
    best = max(p.tokens_per_s for p in points)
    return spent + next_budget / points[-1].tokens_per_s > COST_SHARE * per_step / best


def _too_small(cfg: AppConfig, role: str, found: dict, memory: dict) -> Exception:
    from klppo_train.preflight import UserError  # the run's one-line, exit-2 error

    need = found["points"][0]["memory_gib"]
    return UserError(
        f"{KEYS[role]}=auto: one sequence of {longest_sequence(cfg)} tokens needs "
        f"{need:.2f} GiB, more than the {memory['allowance_gib']:.2f} GiB left under "
        f"trainer.memory_limit_gib={cfg.trainer.memory_limit_gib:g} ({memory['limit_gib']:.2f} "
        f"GiB, {memory['in_use_gib']:.2f} in use, {memory['optimizer_state_gib']:.2f} for "
        "the optimizer state): raise the limit or shorten the sequences"
    )


def choose_budgets(c: Components, cfg: AppConfig, path=None) -> RunBudgets:
    """The run's budgets: the config's numbers, and for ``auto`` ones the probe's choice
    (printed as a table; all of it in ``budgets.json`` at ``path``)."""
    auto = [role for role in KEYS if configured(cfg, role) == AUTO]
    probe = _probe(c, cfg, auto) if auto else None
    probed = {}
    for role in auto:
        found = probe["roles"][role]  # None: the pass does not run; any valid value will do
        probed[role] = (
            (found["chosen"], "auto")
            if found
            else (3 * longest_sequence(cfg), "auto (pass not run)")
        )
    budgets = budgets_from_config(cfg, path, probed)
    budgets.probe = probe
    budgets.write()
    return budgets


def _probe(c: Components, cfg: AppConfig, roles: list[str]) -> dict:
    # As in a step, the engine sleeps while the passes run (on CUDA it frees its KV cache),
    # unless its sleep drops the weights (vLLM level 2: only a weight sync brings them
    # back); awake, the allowance is smaller than the step's, never larger.
    keeps_weights = cfg.rollout.engine != "vllm" or cfg.rollout.vllm.sleep_level == 1
    if keeps_weights:
        c.engine.sleep()
    try:
        return _probe_roles(c, cfg, roles)
    finally:
        if keeps_weights:
            c.engine.wake_up()


def _probe_roles(c: Components, cfg: AppConfig, roles: list[str]) -> dict:
    start = time.perf_counter()
    allowance, memory = memory_allowance(cfg, c)
    found: dict[str, dict | None] = {}
    cuda = default_device().type == "cuda"
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        for role in roles:
            if _unused(c, cfg, role):
                found[role] = None
                continue
            found[role] = probe_role(c, cfg, role, allowance)
            if not found[role]["chosen"]:
                raise _too_small(cfg, role, found[role], memory)
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
            log.info("  %s=auto: its pass does not run here", KEYS[role])
            continue
        fit = " + ".join(f"{coef:.3g}·t^{k}" for k, coef in enumerate(found["fit_gib"]))
        log.info(
            "  %s=auto -> %d (memory ≈ %s GiB; %.1f s)",
            KEYS[role], found["chosen"], fit, found["seconds"],
        )  # fmt: skip
        log.info("    %8s %10s %9s", "tokens", "tokens/s", "+GiB")
        for p in found["points"]:
            mark = "  <- chosen" if p["budget"] == found["chosen"] else ""
            rate = p["budget"] / p["seconds"]
            log.info("    %8d %10.0f %9.3f%s", p["budget"], rate, p["memory_gib"], mark)
