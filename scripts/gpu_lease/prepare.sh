#!/usr/bin/env bash
# Prepares .gpu/ (git-ignored through .git/info/exclude) for a leased GPU machine that has a
# CUDA torch, transformers, pytest... but not this workspace, omegaconf or SmolLM2's weights
# (its GGUF is over the 64 MiB a call may carry), and no network:
#   - wheels of the five distributions, omegaconf 2.3.0 and antlr4 4.9.3 (what the image
#     lacks; 2.3 on purpose: it is what hydra-core 1.3 users have);
#   - SmolLM2-135M's config and tokenizer (random_smollm2.py builds random weights there:
#     timings, memory and MFU are real, accuracies are not).
# Then, with the device tool: run `bash scripts/gpu_lease/run.sh`, carry [".gpu"].
set -euo pipefail
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/whl .gpu/smol
./uvw build --all-packages -o .gpu/whl && rm -f .gpu/whl/*.tar.gz .gpu/whl/.gitignore
python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu/whl omegaconf==2.3.0
python3 -m pip wheel -q --no-deps -w .gpu/whl antlr4-python3-runtime==4.9.3
SMOL=$(./uvw run --no-sync python -c 'from klppo_train.demo.smollm2 import convert_smollm2; print(convert_smollm2("runs/bench/smollm2"))')
cp "$SMOL"/{chat_template.jinja,config.json,generation_config.json,tokenizer.json,tokenizer_config.json} .gpu/smol/
du -sh .gpu
