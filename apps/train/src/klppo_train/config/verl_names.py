"""verl's config names, accepted as aliases of klppo's, in recipes and on the command line.

A verl user can keep their keys: ``actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384``
is ``actor.ppo_max_token_len_per_gpu=16384``, ``actor_rollout_ref.actor.fsdp_config.*`` is
``actor.fsdp.*``, ``strategy=fsdp|fsdp2`` is ``fsdp.strategy=fsdp1|fsdp2``. Keys verl has
and klppo deliberately does not (tensor parallelism, Megatron, Ray) are refused
with the reason, a value klppo cannot honour (``use_remove_padding=false``) too. klppo's
own short names (``rollout.n`` for ``rollout.sampling.n``) and the package-config fields the
app sets itself (refused as keys) live here too. The tables in ``docs/verl-names.md`` are
generated from :data:`ALIASES`, :data:`SHORT_NAMES`, :data:`DERIVED` and :data:`REFUSED`
(:func:`markdown_table`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# verl key → klppo key(s). A key ending in ".*" maps every key under it (the rest kept).
# Most specific first: the first matching rule wins.
ALIASES: dict[str, tuple[str, ...]] = {
    "actor_rollout_ref.model.path": ("model.path",),
    "actor_rollout_ref.model.lora_rank": ("model.lora_rank",),
    "actor_rollout_ref.model.lora_alpha": ("model.lora_alpha",),
    "actor_rollout_ref.model.target_modules": ("model.target_modules",),
    "actor_rollout_ref.model.enable_gradient_checkpointing": ("actor.fsdp.gradient_checkpointing",),
    "actor_rollout_ref.actor.optim.lr": ("actor.lr",),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": ("actor.lr_warmup_steps",),
    "actor_rollout_ref.actor.optim.weight_decay": ("actor.weight_decay",),
    "actor_rollout_ref.actor.clip_ratio": ("actor.clip_ratio_low", "actor.clip_ratio_high"),
    "actor.clip_ratio": ("actor.clip_ratio_low", "actor.clip_ratio_high"),
    "actor_rollout_ref.actor.strategy": ("actor.fsdp.strategy",),
    "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params": (
        "actor.fsdp.min_num_params",
    ),
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size": (
        "actor.ulysses_sequence_parallel_size",
    ),
    "actor_rollout_ref.actor.fsdp_config.*": ("actor.fsdp.*",),
    "actor_rollout_ref.actor.*": ("actor.*",),
    "actor_rollout_ref.ref.strategy": ("ref.fsdp.strategy",),
    "actor_rollout_ref.ref.fsdp_config.wrap_policy.min_num_params": ("ref.fsdp.min_num_params",),
    "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size": (
        "ref.ulysses_sequence_parallel_size",
    ),
    "actor_rollout_ref.ref.fsdp_config.*": ("ref.fsdp.*",),
    "actor_rollout_ref.ref.*": ("ref.*",),
    "actor_rollout_ref.rollout.name": ("rollout.engine",),
    "actor_rollout_ref.rollout.*": ("rollout.*",),
    # verl's fully-async rollout pool: R = rollout.nnodes × rollout.n_gpus_per_node
    "rollout.n_gpus_per_node": ("async_training.rollout_ranks",),
    "critic.optim.lr": ("critic.lr",),
    "critic.optim.lr_warmup_steps": ("critic.lr_warmup_steps",),
    "critic.optim.weight_decay": ("critic.weight_decay",),
    "critic.strategy": ("critic.fsdp.strategy",),
    "critic.model.fsdp_config.wrap_policy.min_num_params": ("critic.fsdp.min_num_params",),
    "critic.model.fsdp_config.ulysses_sequence_parallel_size": (
        "critic.ulysses_sequence_parallel_size",
    ),
    "critic.model.fsdp_config.*": ("critic.fsdp.*",),
    "critic.model.enable_gradient_checkpointing": ("critic.fsdp.gradient_checkpointing",),
    "critic.model.path": ("critic.model_path",),
    "critic.model.lora_rank": ("critic.lora_rank",),
    "critic.model.lora_alpha": ("critic.lora_alpha",),
    "critic.model.target_modules": ("critic.target_modules",),
    "reward_model.model.path": ("reward_model.path",),
    "reward_model.model.input_tokenizer": ("reward_model.retemplate",),
    "reward_model.strategy": ("reward_model.fsdp.strategy",),
    "reward_model.model.fsdp_config.wrap_policy.min_num_params": (
        "reward_model.fsdp.min_num_params",
    ),
    "reward_model.model.fsdp_config.*": ("reward_model.fsdp.*",),
    # DAPO's recipes pass it to the reward manager (with a `+`, which the overrides accept)
    "reward_model.reward_kwargs.overlong_buffer_cfg.*": ("reward_model.overlong_buffer.*",),
    "data.max_response_length": ("rollout.sampling.max_new_tokens",),
    "trainer.default_local_dir": ("trainer.run_dir",),
    "actor_rollout_ref.nccl_timeout": ("trainer.collective_timeout_s",),
}

# klppo's short names (verl's flat ones) for fields of the packages' configs that the app's
# sections hold: ``rollout.n`` is ``rollout.sampling.n``. Applied after ALIASES.
SHORT_NAMES: dict[str, tuple[str, ...]] = {
    **{f"rollout.{k}": (f"rollout.sampling.{k}",) for k in ("n", "temperature", "top_p", "top_k")},
    "rollout.response_length": ("rollout.sampling.max_new_tokens",),
    **{
        f"rollout.{k}": (f"rollout.vllm.{k}",)
        for k in (
            "gpu_memory_utilization",
            "kv_cache_space_gib",
            "max_num_seqs",
            "max_num_batched_tokens",
            "enable_prefix_caching",
            "disable_log_stats",
            "enforce_eager",
        )
    },
    **{
        f"{role}.fsdp.param_dtype": (f"{role}.fsdp.mixed_precision.param_dtype",)
        for role in ("actor", "ref", "critic")
    },
    "model.gradient_checkpointing": (
        "actor.fsdp.gradient_checkpointing",
        "critic.fsdp.gradient_checkpointing",
    ),
}

# Fields of the packages' configs that the app sets itself: a value from the user other than
# the schema's default (a printed config loads again) would be overwritten, so it is refused
# with where it comes from (klppo_train.config.schema).
DERIVED: dict[str, str] = {
    "rollout.sampling.seed": "per-request seeds come from trainer.seed and the step",
    "rollout.vllm.seed": "from trainer.seed",
    "rollout.vllm.dtype": "from model.dtype",
    "rollout.vllm.max_model_len": "data.max_prompt_length + rollout.response_length",
    "rollout.hf.max_model_len": "data.max_prompt_length + rollout.response_length",
    "rollout.hf.pad_token_id": "the tokenizer's",
    "rollout.hf.eos_token_ids": "the tokenizer's",
    "ref.fsdp.gradient_checkpointing": "the reference runs no backward (nothing to recompute)",
}

MEGATRON = "klppo shards with FSDP (torch.distributed), not Megatron"

# verl key → why klppo refuses it (the value it accepts, if any, follows "only ").
REFUSED: dict[str, str] = {
    "actor_rollout_ref.rollout.tensor_model_parallel_size": (
        "klppo's rollout runs one engine per rank, without tensor parallelism: only 1"
    ),
    "actor_rollout_ref.model.use_remove_padding": (
        "klppo always packs sequences (remove padding): only true"
    ),
    "critic.model.use_remove_padding": "klppo always packs sequences (remove padding): only true",
    "reward_model.model.use_remove_padding": (
        "klppo always packs sequences (remove padding): only true"
    ),
    "reward_model.ulysses_sequence_parallel_size": (
        "klppo's reward model scores whole rows (Ulysses splits the actor's, reference's and "
        "critic's: actor.ulysses_sequence_parallel_size): only 1"
    ),
    "reward_model.enable_resource_pool": (
        "klppo's reward model shares the ranks of the other roles: only false"
    ),
    "reward_model.n_gpus_per_node": "klppo's reward model shares the other roles' ranks: only 0",
    "reward_model.nnodes": "klppo's reward model shares the other roles' ranks: only 0",
    "reward_model.micro_batch_size": (
        "the global micro-batch size is deprecated in verl too: use "
        "reward_model.micro_batch_size_per_gpu (only null)"
    ),
    "reward_model.max_length": (
        "klppo scores the whole sequence (prompt and response are capped by "
        "data.max_prompt_length and rollout.response_length): only null"
    ),
    "reward_model.reward_manager": (
        "klppo combines rule and reward-model scores with reward_model.combine: only naive"
    ),
    "reward_model.launch_reward_fn_async": "klppo scores in the step: only false",
    "reward_model.model.trust_remote_code": "klppo loads transformers' own classes: only false",
    "reward_model.model.external_lib": "klppo loads transformers' own classes: only null",
    "actor_rollout_ref.actor.megatron.*": MEGATRON,
    "actor_rollout_ref.ref.megatron.*": MEGATRON,
    "critic.megatron.*": MEGATRON,
    "ray_init.*": "klppo runs under torchrun (torch.distributed), not Ray",
    "trainer.ray_wait_register_center_timeout": "klppo runs under torchrun, not Ray",
    "async_training.staleness_threshold": (
        "verl's fully-async fraction of a batch that may come from older weights (streamed "
        "samples); klppo bounds whole steps: async_training.max_staleness_steps (only 0)"
    ),
    "rollout.max_head_offpolicyness": (
        "AReaL's name: klppo's is async_training.max_staleness_steps, with "
        "async_training.enable=true (only 0)"
    ),
    "rollout.nnodes": (
        "verl's generating ranks are rollout.nnodes × rollout.n_gpus_per_node, klppo's "
        "async_training.rollout_ranks; rollout.n_gpus_per_node alone sets it, so for more "
        "nodes set async_training.rollout_ranks to the product: only 1"
    ),
}

# The one value of a refused key that klppo does honour (so verl's defaults pass).
ACCEPTED_VALUES: dict[str, Callable[[Any], bool]] = {
    "actor_rollout_ref.rollout.tensor_model_parallel_size": lambda v: v == 1,
    "actor_rollout_ref.model.use_remove_padding": lambda v: v is True,
    "critic.model.use_remove_padding": lambda v: v is True,
    "reward_model.model.use_remove_padding": lambda v: v is True,
    "reward_model.ulysses_sequence_parallel_size": lambda v: v == 1,
    "reward_model.enable_resource_pool": lambda v: v is False,
    "reward_model.n_gpus_per_node": lambda v: v == 0,
    "reward_model.nnodes": lambda v: v == 0,
    "reward_model.micro_batch_size": lambda v: v is None,
    "reward_model.max_length": lambda v: v is None,
    "reward_model.reward_manager": lambda v: v == "naive",
    "reward_model.launch_reward_fn_async": lambda v: v is False,
    "reward_model.model.trust_remote_code": lambda v: v is False,
    "reward_model.model.external_lib": lambda v: v is None,
    "async_training.staleness_threshold": lambda v: v == 0,
    "rollout.max_head_offpolicyness": lambda v: v == 0,
    "rollout.nnodes": lambda v: v == 1,
}

# verl values that mean a klppo value: the policy's tokenizer path in input_tokenizer asks for
# re-templating (klppo: when the tokenizers differ), null for none.
VALUE_MAPS: dict[str, Callable[[Any], Any]] = {
    "reward_model.model.input_tokenizer": lambda v: "never" if v is None else "auto",
    "trainer.logger": lambda v: [v] if isinstance(v, str) else v,  # verl accepts one name
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


def _rename(table: dict[str, tuple[str, ...]], key: str) -> list[str]:
    for rule, targets in table.items():
        rest = _match(rule, key)
        if rest is not None:
            return [_target(t, rest) for t in targets]
    return [key]


def translate(key: str, value: Any) -> tuple[list[tuple[str, Any]], str | None]:
    """``(klppo (key, value) pairs, refusal or None)`` for one dotted key: verl's names
    (:data:`ALIASES`), then klppo's short names (:data:`SHORT_NAMES`); klppo's own keys (and
    unknown ones, left to the schema check) pass through unchanged. A refused key with its
    one accepted value (verl's default) is dropped without a refusal."""
    refused = _refused_rule(key)
    if refused is not None:
        accepted = ACCEPTED_VALUES.get(refused)
        ok = accepted is not None and accepted(value)
        return [], None if ok else f"{key}={value!r}: {REFUSED[refused]}"
    names = [short for name in _rename(ALIASES, key) for short in _rename(SHORT_NAMES, name)]
    value = VALUE_MAPS[key](value) if key in VALUE_MAPS else value
    return [(name, _value(name, value)) for name in names], None


def _value(key: str, value: Any) -> Any:
    if key.endswith("fsdp.strategy") and isinstance(value, str):
        return STRATEGIES.get(value, value)
    return value


def markdown_table() -> str:
    """The docs tables: every verl key (pattern) klppo accepts, klppo's short names, the
    keys klppo sets itself, and the verl keys it refuses."""
    lines = ["| verl key | klppo key |", "|---|---|"]
    lines += [f"| `{verl}` | {', '.join(f'`{k}`' for k in ks)} |" for verl, ks in ALIASES.items()]
    lines += ["", "| short name | stands for |", "|---|---|"]
    lines += [
        f"| `{name}` | {', '.join(f'`{k}`' for k in ks)} |" for name, ks in SHORT_NAMES.items()
    ]
    lines += ["", "| set by klppo, refused as a key | from |", "|---|---|"]
    lines += [f"| `{key}` | {reason} |" for key, reason in DERIVED.items()]
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

The app's sections hold the packages' own configs (`actor.fsdp` is `fsdp_sharding`'s
`ShardingConfig`, `rollout.sampling` / `rollout.vllm` / `rollout.hf` are `rollout`'s
`SamplingConfig` / `VLLMConfig` / `HFEngineConfig`), so every field of them is a key;
verl's flat names for the most used ones (`rollout.n`, `rollout.gpu_memory_utilization`,
`actor.fsdp.param_dtype`, ...) are short names for them.

This file is generated from `klppo_train/config/verl_names.py` (`ALIASES`, `SHORT_NAMES`,
`DERIVED`, `REFUSED`); a test
checks that it is current:

    ./uvw run python -m klppo_train.config.verl_names > docs/verl-names.md

<!-- generated table -->
"""

if __name__ == "__main__":
    print(DOC_HEADER + markdown_table(), end="")
