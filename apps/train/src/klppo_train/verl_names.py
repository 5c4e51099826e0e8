"""verl's config names, accepted as aliases of klppo's, in recipes and on the command line.

A verl user can keep their keys: ``actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384``
is ``actor.ppo_max_token_len_per_gpu=16384``, ``actor_rollout_ref.actor.fsdp_config.*`` is
``actor.fsdp.*``, ``strategy=fsdp|fsdp2`` is ``fsdp.strategy=fsdp1|fsdp2``. Keys verl has
and klppo deliberately does not (sequence/tensor parallelism, Megatron, Ray) are refused
with the reason, a value klppo cannot honour (``use_remove_padding=false``) too. The table
in ``docs/verl-names.md`` is generated from :data:`ALIASES` and :data:`REFUSED`
(:func:`markdown_table`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# verl key → klppo key(s). A key ending in ".*" maps every key under it (the rest kept).
# Most specific first: the first matching rule wins.
ALIASES: dict[str, tuple[str, ...]] = {
    "actor_rollout_ref.model.path": ("model.path",),
    "actor_rollout_ref.model.enable_gradient_checkpointing": ("model.gradient_checkpointing",),
    "actor_rollout_ref.actor.optim.lr": ("actor.lr",),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": ("actor.lr_warmup_steps",),
    "actor_rollout_ref.actor.optim.weight_decay": ("actor.weight_decay",),
    "actor_rollout_ref.actor.clip_ratio": ("actor.clip_ratio_low", "actor.clip_ratio_high"),
    "actor.clip_ratio": ("actor.clip_ratio_low", "actor.clip_ratio_high"),
    "actor_rollout_ref.actor.strategy": ("actor.fsdp.strategy",),
    "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params": (
        "actor.fsdp.min_num_params",
    ),
    "actor_rollout_ref.actor.fsdp_config.*": ("actor.fsdp.*",),
    "actor_rollout_ref.actor.*": ("actor.*",),
    "actor_rollout_ref.ref.strategy": ("ref.fsdp.strategy",),
    "actor_rollout_ref.ref.fsdp_config.wrap_policy.min_num_params": ("ref.fsdp.min_num_params",),
    "actor_rollout_ref.ref.fsdp_config.*": ("ref.fsdp.*",),
    "actor_rollout_ref.ref.*": ("ref.*",),
    "actor_rollout_ref.rollout.name": ("rollout.engine",),
    "actor_rollout_ref.rollout.*": ("rollout.*",),
    "critic.optim.lr": ("critic.lr",),
    "critic.optim.lr_warmup_steps": ("critic.lr_warmup_steps",),
    "critic.optim.weight_decay": ("critic.weight_decay",),
    "critic.strategy": ("critic.fsdp.strategy",),
    "critic.model.fsdp_config.wrap_policy.min_num_params": ("critic.fsdp.min_num_params",),
    "critic.model.fsdp_config.*": ("critic.fsdp.*",),
    "critic.model.enable_gradient_checkpointing": ("model.gradient_checkpointing",),
    "data.max_response_length": ("rollout.response_length",),
    "trainer.default_local_dir": ("trainer.run_dir",),
}

MEGATRON = "klppo shards with FSDP (torch.distributed), not Megatron"

# verl key → why klppo refuses it (the value it accepts, if any, follows "only ").
REFUSED: dict[str, str] = {
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": (
        "klppo has no sequence parallelism (Ulysses): only 1"
    ),
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": (
        "klppo has no sequence parallelism (Ulysses): only 1"
    ),
    "critic.ulysses_sequence_parallel_size": "klppo has no sequence parallelism (Ulysses): only 1",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": (
        "klppo's rollout runs one engine per rank, without tensor parallelism: only 1"
    ),
    "actor_rollout_ref.model.use_remove_padding": (
        "klppo always packs sequences (remove padding): only true"
    ),
    "critic.model.use_remove_padding": "klppo always packs sequences (remove padding): only true",
    "critic.model.path": (
        "klppo's critic is a value head on the actor's backbone: only the actor's model.path"
    ),
    "trainer.logger": (
        "klppo prints to the console and writes metrics.jsonl in the run directory: only console"
    ),
    "actor_rollout_ref.actor.megatron.*": MEGATRON,
    "actor_rollout_ref.ref.megatron.*": MEGATRON,
    "critic.megatron.*": MEGATRON,
    "ray_init.*": "klppo runs under torchrun (torch.distributed), not Ray",
    "trainer.ray_wait_register_center_timeout": "klppo runs under torchrun, not Ray",
    "trainer.project_name": "names for experiment trackers; klppo writes to trainer.run_dir",
    "trainer.experiment_name": "names for experiment trackers; klppo writes to trainer.run_dir",
}

# The one value of a refused key that klppo does honour (so verl's defaults pass).
ACCEPTED_VALUES: dict[str, Callable[[Any], bool]] = {
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": lambda v: v == 1,
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": lambda v: v == 1,
    "critic.ulysses_sequence_parallel_size": lambda v: v == 1,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": lambda v: v == 1,
    "actor_rollout_ref.model.use_remove_padding": lambda v: v is True,
    "critic.model.use_remove_padding": lambda v: v is True,
    "trainer.logger": lambda v: v == "console" or list(v) == ["console"],
}

# Values that differ: verl's FSDP1 is ``strategy=fsdp``.
STRATEGIES = {"fsdp": "fsdp1", "fsdp1": "fsdp1", "fsdp2": "fsdp2"}


def _match(rule: str, key: str) -> str | None:
    """The part of ``key`` after ``rule``'s prefix ('' for an exact match), or None."""
    if rule.endswith(".*"):
        prefix = rule[:-1]
        return key[len(prefix) :] if key.startswith(prefix) else None
    return "" if key == rule else None


def _target(target: str, rest: str) -> str:
    return target[:-1] + rest if target.endswith(".*") else target


def _refused_rule(key: str) -> str | None:
    return next((rule for rule in REFUSED if _match(rule, key) is not None), None)


def translate(key: str, value: Any) -> tuple[list[tuple[str, Any]], str | None]:
    """``(klppo (key, value) pairs, refusal or None)`` for one dotted key; klppo's own keys
    (and unknown ones, left to the schema check) pass through unchanged. A refused key with
    its one accepted value (verl's default) is dropped without a refusal."""
    refused = _refused_rule(key)
    if refused is not None:
        accepted = ACCEPTED_VALUES.get(refused)
        ok = accepted is not None and accepted(value)
        return [], None if ok else f"{key}={value!r}: {REFUSED[refused]}"
    for rule, targets in ALIASES.items():
        rest = _match(rule, key)
        if rest is not None:
            pairs = [(_target(t, rest), value) for t in targets]
            return [(k, _value(k, v)) for k, v in pairs], None
    return [(key, value)], None


def _value(key: str, value: Any) -> Any:
    if key.endswith("fsdp.strategy") and isinstance(value, str):
        return STRATEGIES.get(value, value)
    return value


def markdown_table() -> str:
    """The docs table: every verl key (pattern) klppo accepts and the ones it refuses."""
    lines = ["| verl key | klppo key |", "|---|---|"]
    lines += [f"| `{verl}` | {', '.join(f'`{k}`' for k in ks)} |" for verl, ks in ALIASES.items()]
    lines += ["", "| refused verl key | why |", "|---|---|"]
    lines += [f"| `{verl}` | {reason} |" for verl, reason in REFUSED.items()]
    return "\n".join(lines) + "\n"


DOC_HEADER = """# verl's config names in klppo

klppo accepts verl's dotted keys as aliases of its own, in recipes and on the command line
(`actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384` is
`actor.ppo_max_token_len_per_gpu=16384`). A key not in the first table and not one of
klppo's own is an error; all bad keys of a command are reported at once. verl keys that name
what klppo has under the same section and name (`critic.ppo_micro_batch_size_per_gpu`,
`algorithm.kl_ctrl.kl_coef`, `data.train_batch_size`, `trainer.total_epochs`, ...) need no
alias. Values: `strategy=fsdp` is FSDP1 (`fsdp.strategy=fsdp1`), `fsdp2` FSDP2.
`trainer.n_gpus_per_node` × `trainer.nnodes` must equal the launch's world size.

This file is generated from `klppo_train/verl_names.py` (`ALIASES`, `REFUSED`); a test
checks that it is current:

    ./uvw run python -m klppo_train.verl_names > docs/verl-names.md

<!-- generated table -->
"""

if __name__ == "__main__":
    print(DOC_HEADER + markdown_table(), end="")
