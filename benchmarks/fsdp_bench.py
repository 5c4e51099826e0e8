"""FSDP2 levers side by side: prefetch, resharding, checkpointing, offload on one model.

    ./uvw run python benchmarks/fsdp_bench.py [--hidden 512] [--layers 8] [--steps 6]

The command launches itself under ``torch.distributed.run`` (2 processes on CPU/gloo; one
per GPU under NCCL) and prints rank 0's results. Every variant trains a fresh Qwen2-style
model (built from a config, same seed, fp32 master weights, sdpa, untied embeddings) with
``shard_model(model, ShardingConfig(...))`` and AdamW (``foreach=True``) on the same batches:
1 warm-up step, then ``--steps`` timed steps. Variants (the ShardingConfig fields set; all
others keep the library defaults, i.e. backward prefetch on, forward prefetch off):

- no prefetch:        forward_prefetch=False, backward_prefetch=False (the baseline)
- forward prefetch:   forward_prefetch=True, backward_prefetch=False
- fwd+bwd prefetch:   forward_prefetch=True, backward_prefetch=True
- reshard off:        reshard_after_forward=False
- grad checkpointing: gradient_checkpointing=True
- offload:            offload_policy=True (CPUOffloadPolicy; a no-op without a GPU)

Columns: median step time (slowest rank per step), ratio to "no prefetch", peak memory and
the final loss (mean over ranks of the last step). The final losses must agree across
variants (same data, same init; the levers change scheduling, not maths).

Peak memory on CPU is rank 0's peak RSS growth during the variant's steps (VmHWM from
/proc/self/status, reset by writing "5" to /proc/self/clear_refs after the model is sharded
and glibc's free heap is trimmed; model construction is not included). On CUDA the script reports
``torch.cuda.max_memory_allocated`` instead (absolute, reset after sharding), and adds
tokens/s and MFU = 6 · params · tokens/s / (GPUs · ``--peak-tflops``).

On CPU/gloo the collectives are synchronous, so prefetch cannot overlap anything; expect the
prefetch rows within noise (timings on a shared 2-core VM move by ±20–30 % run to run).
Prints a markdown table and writes ``benchmarks/results/fsdp_bench.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import RESULTS_DIR, write_results

ROOT = Path(__file__).resolve().parents[1]
RESULTS = RESULTS_DIR / "fsdp_bench.json"
BASELINE = "no prefetch"
VARIANTS: dict[str, dict] = {
    "no prefetch": {"forward_prefetch": False, "backward_prefetch": False},
    "forward prefetch": {"forward_prefetch": True, "backward_prefetch": False},
    "fwd+bwd prefetch": {"forward_prefetch": True, "backward_prefetch": True},
    "reshard off": {"reshard_after_forward": False},
    "grad checkpointing": {"gradient_checkpointing": True},
    "offload": {"offload_policy": True},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="global rows per step")
    parser.add_argument("--steps", type=int, default=6, help="timed steps (after 1 warm-up)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=int, default=None, help="default: GPUs, or 2 on CPU")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="per GPU (H100 bf16)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON file to write")
    # internal: a rank under torchrun; the folder holds args.json in and result.json out
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- worker side


def build_model(args: argparse.Namespace, device):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = max(1, args.hidden // 64)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=64 * max(1, round(args.hidden * 8 / 3 / 64)),
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=2 if heads % 2 == 0 else 1,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(args.seed)
    with torch.device(device):
        return Qwen2ForCausalLM(config).float()


def step_batch(args: argparse.Namespace, step: int):
    """The global batch of ``step``: identical for every variant."""
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=gen)


class CpuPeak:
    """Peak RSS growth of this process since ``reset`` (Linux /proc)."""

    metric = "peak RSS growth of rank 0 (MiB)"

    @staticmethod
    def _kib(field: str) -> int:
        status = Path("/proc/self/status").read_text()
        return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.M).group(1))

    def reset(self) -> None:
        # Hand freed heap back to the OS, so earlier variants' leftovers do not hide growth
        # (no-op where libc is not glibc).
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
        self.base = self._kib("VmRSS")

    def peak_mib(self) -> float:
        return (self._kib("VmHWM") - self.base) / 1024


class CudaPeak:
    """``torch.cuda.max_memory_allocated`` since ``reset`` (absolute, this rank's GPU)."""

    metric = "torch.cuda.max_memory_allocated of rank 0 (MiB)"

    def reset(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats()

    def peak_mib(self) -> float:
        import torch

        return torch.cuda.max_memory_allocated() / 2**20


def run_variant(args, name: str, overrides: dict, device, peak) -> dict:
    import torch
    import torch.distributed as dist

    from fsdp_sharding import ShardingConfig, shard_model

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = args.batch // world
    model = build_model(args, device)
    params = sum(p.numel() for p in model.parameters())
    model = shard_model(model, ShardingConfig(**overrides), device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=True)
    gc.collect()
    peak.reset()
    times, losses = [], []
    for step in range(1 + args.steps):
        ids = step_batch(args, step)[rank * rows : (rank + 1) * rows].to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())  # .item() synchronizes on CUDA
        times.append(time.perf_counter() - start)
    peak_mib = peak.peak_mib()
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    step_s = statistics.median(slowest.tolist()[1:])  # step 0 is the warm-up
    del model, optimizer, loss
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    row = {
        "variant": name,
        "config": overrides,
        "params": params,
        "step_s": step_s,
        "step_times_s": slowest.tolist()[1:],
        "warmup_s": slowest.tolist()[0],
        "peak_mib": peak_mib,
        "final_loss": losses[-1],
        "losses": losses,
        "tokens_per_s": args.batch * args.seq_len / step_s,
    }
    if device.type == "cuda":
        flops = 6 * params * row["tokens_per_s"]
        row["mfu"] = flops / (world * args.peak_tflops * 1e12)
    if rank == 0:
        print(f"[fsdp_bench] {name}: {step_s:.3f} s/step, loss {losses[-1]:.6f}", flush=True)
    return row


def worker(folder: Path) -> None:
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():  # GPU path: NCCL, bf16 (ShardingConfig's GPU default)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        device, peak = torch.device("cuda", local_rank), CudaPeak()
    else:  # CPU path: gloo, fp32
        dist.init_process_group("gloo")
        device, peak = torch.device("cpu"), CpuPeak()
    args = argparse.Namespace(**json.loads((folder / "args.json").read_text()))
    world = dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} is not divisible by the world size {world}")
    rows = [run_variant(args, name, cfg, device, peak) for name, cfg in VARIANTS.items()]
    if dist.get_rank() == 0:
        result = {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "backend": dist.get_backend(),
            "world_size": world,
            "threads_per_rank": torch.get_num_threads(),
            "torch": torch.__version__,
            "memory_metric": peak.metric,
            "model": {
                "hidden": args.hidden,
                "layers": args.layers,
                "vocab": args.vocab,
                "params": rows[0]["params"],
            },
            "seq_len": args.seq_len,
            "batch": args.batch,
            "steps": args.steps,
            "rows": rows,
        }
        (folder / "result.json").write_text(json.dumps(result, indent=2))
    # Both ranks done talking before teardown: a rank tearing gloo down while its peer
    # is still busy aborted once ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- parent side


def launch(args: argparse.Namespace, folder: Path) -> dict:
    """Run the workers under torchrun; return rank 0's result. The options travel in a file:
    torchrun's own parser would reject some of ours (``--nproc`` is ambiguous to it)."""
    spec = {k: v for k, v in vars(args).items() if k not in ("out", "worker")}
    (folder / "args.json").write_text(json.dumps(spec))
    nproc = args.nproc
    if nproc is None:
        import torch

        nproc = torch.cuda.device_count() if torch.cuda.is_available() else 2
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(Path(__file__).resolve()),
        "--worker",
        str(folder),
    ]
    run = subprocess.run(cmd)
    if run.returncode != 0:
        raise SystemExit(f"fsdp_bench: torchrun failed with exit code {run.returncode}")
    return json.loads((folder / "result.json").read_text())


def print_table(data: dict) -> None:
    model, rows = data["model"], data["rows"]
    cuda = "mfu" in rows[0]
    print(
        f"{data['device']} ({data['backend']}), {data['world_size']} ranks × "
        f"{data['threads_per_rank']} threads, torch {data['torch']}; Qwen2 "
        f"{model['params'] / 1e6:.1f}M params (hidden {model['hidden']}, {model['layers']} "
        f"layers, vocab {model['vocab']}), {data['batch']}×{data['seq_len']} tokens/step, "
        f"median of {data['steps']} steps after 1 warm-up"
    )
    memory = "peak alloc MiB" if cuda else "RSS +MiB"
    header = f"| variant            | step s | vs no prefetch | {memory} | final loss  |"
    header += " tokens/s | MFU % |" if cuda else ""
    print(header + "\n|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    base = next(r["step_s"] for r in rows if r["variant"] == BASELINE)
    digits = 4 if cuda else 3  # GPU steps take tens of milliseconds
    for r in rows:
        line = (
            f"| {r['variant']:<18} | {r['step_s']:>6.{digits}f} | {r['step_s'] / base:>13.2f}x "
            f"| {r['peak_mib']:>{len(memory)}.0f} | {r['final_loss']:>11.6f} |"
        )
        if cuda:
            line += f" {r['tokens_per_s']:>8.0f} | {100 * r['mfu']:>5.1f} |"
        print(line)
    losses = [r["final_loss"] for r in rows]
    print(f"final loss spread across variants: {max(losses) - min(losses):.2e}")
    print(f"memory: {data['memory_metric']}")


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args.worker)
        return
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        data = launch(args, Path(tmp))
    data["wall_s"] = time.perf_counter() - start
    print_table(data)
    print(f"wall time {data['wall_s']:.0f} s")
    write_results(data, args.out)


if __name__ == "__main__":
    main()
