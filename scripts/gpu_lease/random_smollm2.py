#!/usr/bin/env python3
"""SmolLM2-135M's architecture and tokenizer with random weights, for a leased GPU machine that
cannot hold its GGUF (94 MB, over the 64 MiB a call carries): timings, memory and MFU are
real, accuracies are not.

    python3 scripts/gpu_lease/random_smollm2.py .gpu/smol runs/bench/smollm2
"""

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main(source: Path, out: Path) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(source), dtype=torch.float32
    )
    model.save_pretrained(out)
    for path in source.iterdir():
        if path.name != "config.json":
            shutil.copy(path, out / path.name)
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"random-weight SmolLM2 at {out}: {millions:.1f}M parameters")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
