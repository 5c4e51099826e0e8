"""TRL's PPO (``trl.experimental.ppo``, trl 1.12.0) on SmolLM2-135M-Instruct: seconds per step.

    ./uvw run python benchmarks/trl_ppo_bench.py [--settings 16x4x64,8x1x32] [--steps 4]
        [--variants fp32,bf16] [--with-klppo] [--klppo-row bf16] [--out PATH]

Same model, prompts and ``PROMPTSxSAMPLESxTOKENS`` settings as ``ppo_step_bench.py`` (its cached
``runs/bench/smollm2`` and ``runs/bench/data``; made by its ``prepare()`` if missing), same
recipe numbers, read from ``smollm2_arith.yaml`` (actor and critic lr, weight decay, kl_coef in
the reward, gamma, lam, temperature, value clip; 1 PPO epoch, one mini-batch per step). TRL
lives in its own venv (``runs/bench/trl-venv``, made with the project's uv, torch from the
workspace's local CPU wheel; the workspace's uv.lock is untouched); each row is one worker
process in it (this file with ``--worker``), its peak RSS from ``wait4``. Variants:
``fp32``; ``bf16`` (``bf16=True``: autocast on the policy+value training forward only);
``bf16w`` (also every model loaded in bfloat16); ``+ckpt`` after any (gradient
checkpointing, policy and critic).
``--with-klppo`` runs a ppo_step_bench row of each setting too (``--klppo-row``, default
``bf16``), and the ratio; then it also measures the matmul peaks and records the klppo row's
step floor and work floor (``ppo_step_bench.floors``) and TRL's step ÷ that step floor (TRL
runs every prompt copy and the policy's LM head on every token: about the work that floor
counts, less the critic's head, for klppo's token counts as TRL samples its own responses).
``--allocator`` (default ``auto``) is TRL's, a ``trainer.allocator`` value set up as klppo's
trainer does (``auto``: tcmalloc preloaded where the system has it, else glibc's malloc told to
keep freed memory), so the comparison is not one of allocators.
The step reported is the median of steps 2..``--steps`` (``_results.steady_index``: the
first pays one-off costs, the allocator's heap grows over the first two). Writes
``benchmarks/results/trl_ppo_bench.json``.

Read in trl-1.12.0-py3-none-any.whl, paths under ``trl/`` (1.13.0 has no ``experimental/ppo``):
- ``ppo_trainer.py`` is ``experimental/ppo/ppo_trainer.py``; ``utils.py`` ``experimental/utils.py``.
- ppo_trainer.py:349-364 ``PPOTrainer(args, processing_class, model, ref_model, reward_model,
  train_dataset, value_model, data_collator=None, eval_dataset=None, optimizers=(None, None),
  callbacks=None, peft_config=None)``; 439-444 no ref_model -> a copy of the policy.
- 458-484 (ppo_config.py fields): rollout batch of a step = ``local_batch_size`` =
  ``per_device_train_batch_size * gradient_accumulation_steps`` (also the DataLoader batch, 533);
  ``mini_batch = batch / num_mini_batches``; steps = ``ceil(total_episodes / batch)``
  (``total_episodes`` defaults to epochs * len(dataset)). There is no ``n``: the collator here
  keeps the first PROMPTS rows of each batch and repeats each SAMPLES times.
- 125-144, 690-743: generation and the no-grad logprob/ref/value/reward passes run in chunks
  of ``local_rollout_forward_batch_size``; 620-627 sampling: ``max_new_tokens=response_length``,
  ``temperature`` (default 0.7), top_k 0, top_p 1.
- 729-735 + utils.py:746-793 ``get_reward``: ``getattr(model,
  model.base_model_prefix)(input_ids=, attention_mask=, position_ids=, return_dict=,
  output_hidden_states=, use_cache=)``, then ``model.score(out.hidden_states[-1])`` taken at
  the response's last non-pad token. No callable rewards in 1.12.0: ``ExactAnswer`` below is
  such a module (1.0 if the response's first integer equals ``ground_truth``).
- 211-213, utils.py:771: tokens equal to the pad id are masked everywhere. SmolLM2's pad is
  ``<|im_end|>`` = eos, which is in every chat-templated prompt, so pad = ``<|endoftext|>`` (0).
- 391-401 ``stop_token="eos"`` sets the policy's eos; 718-723 responses cut after it;
  755-759 ``missing_eos_penalty`` is subtracted from the score of responses without eos.
- 771-798 reward = ``-kl_coef * (logp - ref_logp)`` per token + score at the last token; GAE
  with ``gamma``, ``lam``; advantages whitened. 802-850: ``num_ppo_epochs`` (default 4) x
  ``num_mini_batches`` x micro-batches of ``per_device_train_batch_size``, loss = pg +
  ``vf_coef`` * vf, ``optimizer.step()`` under ``accelerator.accumulate`` (no grad clipping).
- 275-294, 492-496: policy and value are one wrapped model with one optimizer (default: one
  lr for both), so ``optimizers=`` passes AdamW with the recipe's two lrs.
- 662 ``on_train_begin`` before the first rollout, 913 ``on_step_end`` once per PPO step (no
  ``on_step_begin``): the timer. 921 ``num_sample_generations`` (default 10) would add eval
  generations inside the loop: set to 0.
- 460 ``Accelerator(gradient_accumulation_steps=...)`` only: mixed precision comes from
  ``ACCELERATE_MIXED_PRECISION``, which transformers 5.19 (training_args.py:1580-1586) does not
  exports from ``bf16=True``, so the worker sets it (the row records what the accelerator used).
- trainer/base_config.py:61-66, 104-105: ``gradient_checkpointing`` defaults True and ``bf16`` to
  ``not fp16``, but PPOTrainer overrides ``train()`` and never enables checkpointing; ``+ckpt``
  enables it on the models (models/utils.py:133-136 turns it off while generating).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from _results import RESULTS_DIR, write_results
from _trl import (
    CACHE,
    bench_inputs,
    ensure_venv,
    print_table,
    run_worker,
    step_timer,
    worker_allocator,
)

PINS = ["trl==1.12.0", "torch==2.13.0+cpu", "transformers==5.19.0", "accelerate==1.15.0"]


def worker(cfg: dict) -> None:
    """In the TRL venv: one PPOTrainer run; each step's seconds go to ``cfg["out"]``."""
    base, _, extra = cfg["variant"].partition("+")
    os.environ.update(TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1", ACCELERATE_USE_CPU="true")
    os.environ.update(HF_HUB_DISABLE_TELEMETRY="1")
    if base != "fp32":
        os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"
    import re
    from types import SimpleNamespace

    import accelerate
    import pyarrow.parquet as pq
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    prompts, samples, tokens = (int(x) for x in cfg["setting"].split("x"))
    batch = prompts * samples
    micro = min(cfg["micro"], batch)
    if batch % micro:
        sys.exit(f"batch {batch} is not a multiple of --micro {micro}")
    tok = transformers.AutoTokenizer.from_pretrained(cfg["model"], padding_side="left")
    tok.pad_token = "<|endoftext|>"
    answers, ids = {}, []
    template = {"add_generation_prompt": True, "tokenize": True, "return_dict": False}
    for row in pq.read_table(cfg["data"]).to_pylist():
        p = list(tok.apply_chat_template(row["prompt"], **template))
        answers[tuple(p)] = int(row["reward_model"]["ground_truth"])
        ids.append(p)
    lengths = sorted({len(p) for p in ids})

    class ExactAnswer(torch.nn.Module):
        base_model_prefix = "rule_scores"  # get_reward calls this, then score(hidden_states[-1])

        def __init__(self) -> None:
            super().__init__()
            self.score = torch.nn.Identity()

        def rule_scores(self, input_ids, attention_mask, **_):
            s = [self.one(r[m].tolist()) for r, m in zip(input_ids, attention_mask, strict=True)]
            s = torch.tensor(s, device=input_ids.device)
            return SimpleNamespace(
                hidden_states=(s[:, None, None].expand(-1, input_ids.shape[1], 1),)
            )

        @staticmethod
        def one(seq: list[int]) -> float:
            for n in lengths:  # the unpadded prompt is a key of `answers`; the rest is the response
                if (key := tuple(seq[:n])) in answers:
                    found = re.search(r"-?\d+", tok.decode(seq[n:], skip_special_tokens=True))
                    return float(found is not None and int(found.group()) == answers[key])
            return 0.0

    dtype = torch.bfloat16 if base == "bf16w" else torch.float32
    lm, seq_cls = transformers.AutoModelForCausalLM, transformers.AutoModelForSequenceClassification
    policy, ref = (lm.from_pretrained(cfg["model"], dtype=dtype) for _ in range(2))
    value = seq_cls.from_pretrained(cfg["model"], num_labels=1, dtype=dtype)
    for m in (policy, ref, value):
        m.config.pad_token_id = tok.pad_token_id
    policy.generation_config.pad_token_id = tok.pad_token_id
    if extra == "ckpt":
        for m in (policy, value):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    r = cfg["recipe"]
    groups = [{"params": list(policy.parameters()), "lr": r["actor_lr"]}]
    groups.append({"params": list(value.parameters()), "lr": r["critic_lr"]})
    opt = torch.optim.AdamW(groups, weight_decay=r["weight_decay"])
    pad = transformers.DataCollatorWithPadding(tok)
    dataset = Dataset.from_dict({"input_ids": ids})
    timer = step_timer()
    with tempfile.TemporaryDirectory(prefix="trl_ppo_bench_") as tmp:
        args = PPOConfig(
            output_dir=tmp, use_cpu=True, bf16=base != "fp32", seed=0, report_to="none",
            save_strategy="no", logging_steps=1, disable_tqdm=True, learning_rate=r["actor_lr"],
            per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
            num_mini_batches=1, local_rollout_forward_batch_size=min(cfg["rollout_micro"], batch),
            total_episodes=cfg["steps"] * batch, response_length=tokens, num_ppo_epochs=1,
            kl_coef=r["kl_coef"], gamma=r["gamma"], lam=r["lam"],
            cliprange_value=r["cliprange_value"], temperature=r["temperature"],
            stop_token="eos", num_sample_generations=0, gradient_checkpointing=extra == "ckpt",
        )  # fmt: skip
        trainer = PPOTrainer(
            args=args, processing_class=tok, model=policy, ref_model=ref,
            reward_model=ExactAnswer(), train_dataset=dataset, value_model=value,
            data_collator=lambda f: pad([x for x in f[:prompts] for _ in range(samples)]),
            eval_dataset=dataset.select(range(8)), callbacks=[timer],
            optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)),
        )  # fmt: skip
        trainer.train()
    log = [h for h in trainer.state.log_history if "objective/scores" in h]
    versions = {m.__name__: m.__version__ for m in (torch, trl, transformers, accelerate)}
    result = {"steps_s": timer.times, "mixed_precision": str(trainer.accelerator.mixed_precision)}
    result.update(micro=micro, grad_accum=batch // micro, versions=versions)
    result.update(lrs=[g["lr"] for g in opt.param_groups], kl_coef=args.kl_coef)
    result.update(allocator=worker_allocator())
    result.update(rollout_micro=args.local_rollout_forward_batch_size)
    result.update(score=log[-1]["objective/scores"] if log else None)
    Path(cfg["out"]).write_text(json.dumps(result))


def recipe_numbers() -> dict[str, float]:
    """The recipe's numbers that TRL's PPOConfig/optimizer take (read in the workspace env)."""
    from ppo_step_bench import RECIPE

    from klppo_train.config.schema import load_config

    c = load_config(RECIPE, [])
    if c.actor.weight_decay != c.critic.weight_decay:
        sys.exit("TRL has one optimizer: the recipe's actor and critic weight decay must agree")
    return {
        "actor_lr": c.actor.lr, "critic_lr": c.critic.lr, "weight_decay": c.actor.weight_decay,
        "kl_coef": c.algorithm.kl_ctrl.kl_coef, "gamma": c.algorithm.gamma,
        "lam": c.algorithm.lam, "cliprange_value": c.critic.cliprange_value,
        "temperature": c.rollout.sampling.temperature,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default="16x4x64,8x1x32")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--variants", default="fp32,bf16", help="fp32|bf16|bf16w, +ckpt")
    parser.add_argument("--micro", type=int, default=16, help="per_device_train_batch_size")
    parser.add_argument("--rollout-micro", type=int, default=32)
    parser.add_argument("--venv", type=Path, default=CACHE / "trl-venv")
    parser.add_argument("--with-klppo", action="store_true")
    parser.add_argument("--klppo-row", default="bf16", help="a ppo_step_bench row name")
    parser.add_argument(
        "--allocator",
        choices=("auto", "tcmalloc", "glibc-retain", "system"),
        default="auto",
        help="TRL's allocator, as trainer.allocator (klppo's rows: trainer.allocator=auto)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "trl_ppo_bench.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    py = ensure_venv(args.venv, PINS)
    model, data = bench_inputs()
    recipe = recipe_numbers()
    rows = []
    if args.with_klppo:
        import ppo_step_bench as psb

        peaks = psb.matmul_peaks({psb.row_dtype(args.klppo_row)})
        shape = psb.model_shape(model)
        print(f"matmul peaks: {peaks}", flush=True)
    for setting in args.settings.split(","):
        klppo_s = None
        if args.with_klppo:
            overrides = [*psb.setting_overrides(setting), *psb.ROWS[args.klppo_row]]
            m = psb.run_row(model, data, overrides, args.steps)
            klppo_s, name = m["timing_s/step"], f"klppo {args.klppo_row}"
            klppo_row = {"setting": setting, "variant": name, "step_s": klppo_s}
            klppo_row.update(peak_rss_gb=m["peak_rss_gb"], allocator="trainer.allocator=auto")
            klppo_row.update(steps_s=m["steps_s"], matmul_gflops=peaks)
            klppo_row.update(psb.floors(m, shape, peaks, setting, args.klppo_row))
            rows.append(klppo_row)
            print(f"  {setting} {name}: {klppo_s:.1f} s/step", flush=True)
        for variant in args.variants.split(","):
            cfg = {"setting": setting, "variant": variant, "steps": args.steps, "micro": args.micro}
            cfg.update(rollout_micro=args.rollout_micro, model=str(model))
            cfg.update(data=str(data / "train.parquet"), recipe=recipe)
            r = {"setting": setting, "variant": f"TRL {variant}"}
            r.update(run_worker(py, str(Path(__file__).resolve()), cfg, args.allocator))
            if klppo_s and r["step_s"]:
                r["trl_over_klppo"] = r["step_s"] / klppo_s
                # TRL runs every prompt copy and the policy's LM head on every token: about the
                # work the step floor counts (less the critic's head; klppo's token counts).
                r["trl_over_floor"] = r["step_s"] / klppo_row["floor_s"]
            rows.append(r)
            step = "failed" if r["step_s"] is None else f"{r['step_s']:.1f} s/step"
            print(f"  {setting} TRL {variant}: {step}", flush=True)
    cols = ["setting", "variant", "step_s", "peak_rss_gb", "allocator", "mixed_precision", "micro"]
    cols += ["grad_accum"]
    cols += ["rollout_micro", "score", "floor_s", "work_floor_s", "trl_over_floor"]
    cols += ["trl_over_klppo"]
    print_table(rows, cols)
    versions = next((r["versions"] for r in rows if "versions" in r), None)
    write_results({"pins": PINS, "versions": versions, "steps": args.steps, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
