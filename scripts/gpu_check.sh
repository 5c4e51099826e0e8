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
# tests run on CPU/gloo there too); then the trainer's CUDA-only optimizer-offload test.
set -euo pipefail

PYTHON=${PYTHON:-python3}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}   # bf16 dense per GPU: H100/H200 989, A100 312
OUT=${OUT:-benchmarks/results/fsdp_bench_cuda.json}

step() { echo; echo "=== $* ==="; }

step "GPU"
echo "+ nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
echo "+ $PYTHON -c 'import torch; ...'"
$PYTHON -c 'import torch; assert torch.cuda.is_available(), "torch has no CUDA"; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'

step "FSDP benchmark on 1 GPU (NCCL, bf16): ~98M params, 8x2048 tokens/step"
BENCH=(benchmarks/fsdp_bench.py --nproc 1 --hidden 768 --layers 8 --vocab 32000
       --seq-len 2048 --batch 8 --steps 10 --peak-tflops "$PEAK_TFLOPS" --out "$OUT")
echo "+ $PYTHON ${BENCH[*]}"
$PYTHON "${BENCH[@]}"
echo "+ summary from $OUT"
$PYTHON - "$OUT" <<'EOF'
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

step "fsdp_sharding tests"
echo "+ $PYTHON -m pytest packages/fsdp_sharding -q"
$PYTHON -m pytest packages/fsdp_sharding -q

step "optimizer offload on CUDA (fsdp.optimizer_offload; refused on CPU, where it is a no-op)"
echo "+ $PYTHON -m pytest apps/train/tests/test_critic.py -q -k optimizer_offload"
$PYTHON -m pytest apps/train/tests/test_critic.py -q -k optimizer_offload

step "done"
