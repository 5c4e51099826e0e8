# ruff: noqa: E501  (the cases read best one per line)
"""Records verl_b178a3cd_advantages.json: verl's own advantage estimators at b178a3cd
(``verl/trainer/ppo/core_algos.py``, with ``masked_*`` from ``verl/utils/torch_functional.py``),
lifted out with ``ast`` and run on fixed float64 inputs (the tests use the same ones). Not a
test; run by hand, from a verl checkout (see record_verl_policy_losses.py for the two files):

    python record_verl_advantages.py > verl_b178a3cd_advantages.json
"""

import ast
import json
import types
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

SRC = Path("/tmp/core_algos.py").read_text()
TF = Path("/tmp/torch_functional.py").read_text()


def extract(source: str, names: set[str]) -> str:
    out = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []
            out.append(ast.unparse(node))
    return "\n\n".join(out)


base = {"torch": torch, "Any": Any, "Optional": Optional}
exec(extract(TF, {"masked_sum", "masked_mean", "masked_var", "masked_whiten"}), base)
verl_F = types.SimpleNamespace(
    **{k: base[k] for k in ("masked_mean", "masked_var", "masked_whiten")}
)
ns = {**base, "verl_F": verl_F, "np": np, "defaultdict": defaultdict, "AlgoConfig": dict}
exec(extract(SRC, {
    "compute_grpo_passk_outcome_advantage", "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_opo_outcome_advantage", "compute_remax_outcome_advantage", "compute_gpg_outcome_advantage",
    "compute_optimal_token_baseline_advantage", "compute_multi_turn_optimal_token_baseline_advantage",
}), ns)  # fmt: skip

D = torch.float64
REWARDS = torch.zeros(6, 5, dtype=D)
LENGTHS = [5, 3, 4, 2, 5, 1]
SCORES = [1.0, 0.0, 0.5, 0.0, 2.0, -1.0]
MASK = torch.zeros(6, 5, dtype=D)
for i, (n, s) in enumerate(zip(LENGTHS, SCORES, strict=True)):
    MASK[i, :n] = 1.0
    REWARDS[i, n - 1] = s
INDEX = np.array(["a", "a", "a", "b", "b", "c"], dtype=object)
HOLES = MASK.clone()
HOLES[0, 1] = HOLES[4, 2] = 0.0  # tool tokens inside two responses
OLD = -torch.linspace(0.1, 2.9, 30, dtype=D).reshape(6, 5)
SUM_PI2 = OLD.exp() ** 2 + torch.linspace(0.01, 0.3, 30, dtype=D).reshape(6, 5)  # ≥ π²
W = torch.linspace(0.6, 1.8, 30, dtype=D).reshape(6, 5)
BASELINES = torch.tensor([0.5, 0.5, 0.5, 1.0, 1.0, -0.5], dtype=D)
cfg = {"norm_adv_by_std_in_grpo": True}
grouped = dict(token_level_rewards=REWARDS.clone(), response_mask=MASK, index=INDEX)
out = {}
for name, fn, kw in [
    ("grpo_passk", "compute_grpo_passk_outcome_advantage",
     dict(token_level_rewards=REWARDS[:5].clone(), response_mask=MASK[:5], index=INDEX[:5], config=cfg)),
    ("reinforce_plus_plus_baseline", "compute_reinforce_plus_plus_baseline_outcome_advantage", grouped),
    ("opo", "compute_opo_outcome_advantage", grouped),
    ("gpg", "compute_gpg_outcome_advantage", {**grouped, "f_norm": 2.0}),
    ("remax", "compute_remax_outcome_advantage",
     dict(token_level_rewards=REWARDS, reward_baselines=BASELINES, response_mask=MASK)),
    ("optimal_token_baseline", "compute_optimal_token_baseline_advantage",
     dict(token_level_rewards=REWARDS, response_mask=MASK, index=INDEX, old_log_probs=OLD,
          sum_pi_squared=SUM_PI2, rollout_is_weights=W)),
    ("optimal_token_baseline_zero_tail", "compute_optimal_token_baseline_advantage",
     dict(token_level_rewards=REWARDS, response_mask=MASK, index=INDEX, old_log_probs=OLD,
          sum_pi_squared=SUM_PI2, handle_zero_tail=True)),
    ("tir_optimal_token_baseline", "compute_multi_turn_optimal_token_baseline_advantage",
     dict(token_level_rewards=REWARDS * HOLES, response_mask=HOLES, index=INDEX, old_log_probs=OLD,
          sum_pi_squared=SUM_PI2)),
]:  # fmt: skip
    kw = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    adv, ret = ns[fn](**kw)
    out[name] = {"advantages": adv.tolist(), "returns": ret.tolist()}
print(json.dumps(out, indent=0))
