"""Records verl_b178a3cd_policy_losses.json: verl's own policy-loss functions at b178a3cd
(``verl/trainer/ppo/core_algos.py``, with ``masked_sum``/``masked_mean`` from
``verl/utils/torch_functional.py``), lifted out with ``ast`` and run with a stand-in
``ActorConfig`` on fixed float64 inputs (the tests use the same ones). Each case:
loss, metrics and d loss/d logprob. Not a test; run by hand, from a verl checkout:

    git -C verl show b178a3cd:verl/trainer/ppo/core_algos.py > /tmp/core_algos.py
    git -C verl show b178a3cd:verl/utils/torch_functional.py > /tmp/torch_functional.py
    python record_verl_policy_losses.py > verl_b178a3cd_policy_losses.json
"""

import ast
import json
import types
from pathlib import Path
from typing import Any, Optional

import torch

src = Path("/tmp/core_algos.py").read_text()
tf = Path("/tmp/torch_functional.py").read_text()


def extract(source, names):
    tree = ast.parse(source)
    out = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []
            out.append(ast.unparse(node))
    return "\n\n".join(out)


ns = {"torch": torch, "Any": Any, "Optional": Optional}
exec(extract(tf, {"masked_sum", "masked_mean"}), ns)
verl_F = types.SimpleNamespace(masked_sum=ns["masked_sum"], masked_mean=ns["masked_mean"])


class ActorConfig:
    def __init__(self, **kw):
        self.clip_ratio = 0.2
        self.clip_ratio_low = None
        self.clip_ratio_high = None
        self.tau_pos = 1.0
        self.tau_neg = 1.05
        self.global_batch_info = {}
        self.policy_loss = types.SimpleNamespace(
            clip_cov_ratio=None,
            clip_cov_lb=None,
            clip_cov_ub=None,
            kl_cov_ratio=None,
            ppo_kl_coef=None,
        )
        self.clip_ratio_c = 3.0
        for k, v in kw.items():
            if hasattr(self.policy_loss, k):
                setattr(self.policy_loss, k, v)
            else:
                setattr(self, k, v)

    def get(self, k, d=None):
        return getattr(self, k, d)


class AlgoConfig:
    pass


DictConfig = dict
ns2 = {
    "torch": torch,
    "Any": Any,
    "Optional": Optional,
    "verl_F": verl_F,
    "ActorConfig": ActorConfig,
    "AlgoConfig": AlgoConfig,
    "DictConfig": DictConfig,
}
names = {
    "agg_loss",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
    "compute_policy_loss_sapo",
    "compute_policy_loss_gpg",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_cispo",
}
exec(extract(src, names), ns2)

D = torch.float64
LOGP = torch.tensor(
    [
        [-1.2, -0.4, -2.1, -0.9, -0.3],
        [-0.6, -1.7, -0.2, -2.4, -1.1],
        [-0.8, -1.0, -1.5, -3.1, -0.7],
    ],
    dtype=D,
)
OLD = torch.tensor(
    [
        [-1.0, -0.5, -2.6, -0.9, -0.6],
        [-0.9, -1.2, -0.3, -2.0, -1.5],
        [-0.5, -1.4, -1.1, -2.9, -0.2],
    ],
    dtype=D,
)
ADV = torch.tensor(
    [[1.5, 1.5, 1.5, 1.5, 1.5], [-0.8, -0.8, -0.8, -0.8, -0.8], [0.4, -1.1, 2.0, 0.3, -0.6]],
    dtype=D,
)
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], dtype=D)
W = torch.tensor(
    [[1.0, 0.8, 1.3, 2.0, 0.5], [1.1, 0.9, 1.0, 0.7, 0.0], [1.2, 1.0, 0.6, 0.0, 0.0]], dtype=D
)

CASES = {
    "vanilla": dict(clip_ratio_low=0.2, clip_ratio_high=0.28),
    "gspo": dict(clip_ratio_low=0.05, clip_ratio_high=0.08),
    "sapo": dict(tau_pos=1.0, tau_neg=1.05),
    "gpg": dict(),
    "clip_cov": dict(
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        clip_cov_ratio=0.2,
        clip_cov_lb=0.02,
        clip_cov_ub=5.0,
    ),
    "kl_cov": dict(kl_cov_ratio=0.2, ppo_kl_coef=0.5),
    "geo_mean": dict(clip_ratio_low=0.2, clip_ratio_high=0.3),
    "cispo": dict(clip_ratio_low=0.2, clip_ratio_high=0.28),
}
out = {}
for mode, kw in CASES.items():
    for weights in (False, True):
        for agg in ("token-mean", "seq-mean-token-sum"):
            cfg = ActorConfig(**kw)
            lp = LOGP.clone().requires_grad_(True)
            torch.manual_seed(0)
            loss, metrics = ns2[f"compute_policy_loss_{mode}"](
                OLD,
                lp,
                ADV,
                MASK,
                loss_agg_mode=agg,
                config=cfg,
                rollout_is_weights=W if weights else None,
            )
            loss.backward()
            out[f"{mode}|{int(weights)}|{agg}"] = {
                "loss": loss.item(),
                "metrics": {k.split("/")[-1]: v for k, v in metrics.items()},
                "grad": lp.grad.tolist(),
            }
print(json.dumps(out, indent=0))
