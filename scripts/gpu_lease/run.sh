#!/usr/bin/env bash
# On the leased GPU machine, from the repository root, after prepare.sh here (carry [".gpu"]):
#   CHECKS="ppo:150 smollm2:150" TOTAL=400 bash scripts/gpu_lease/run.sh
# Installs the carried wheels (--upgrade: a warm machine keeps the last call's), builds the
# random-weight SmolLM2, runs scripts/gpu_check.sh and copies its results under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .gpu/whl/*.whl 2>&1 | grep -v '^WARNING: Target' || true
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
python3 scripts/gpu_lease/random_smollm2.py .gpu/smol runs/bench/smollm2 2>&1 | tail -1
export SMOL_MODEL=$PWD/runs/bench/smollm2
timeout "${TOTAL:-420}" bash scripts/gpu_check.sh 2>&1 | tee "$OUT/gpu_check.log"
cp benchmarks/results/*cuda*.json benchmarks/results/budget_bench.json "$OUT/" 2>/dev/null
cp /tmp/klppo_gpu_check/gpu/metrics.jsonl "$OUT/ppo_gpu_metrics.jsonl" 2>/dev/null
cp /tmp/klppo_gpu_check_smollm2/metrics.jsonl "$OUT/smol_gpu_metrics.jsonl" 2>/dev/null
true
