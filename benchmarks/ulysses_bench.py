"""Ulysses sequence parallelism: one actor update of a long sequence at sp = 1 and sp = 2.

    ./uvw run python benchmarks/ulysses_bench.py [--lengths 2048,4096,8192] [--hidden 512]
        [--layers 8] [--vocab 32000] [--prompt-share 0.125]

The command launches itself under ``torch.distributed.run`` (2 processes, gloo on CPU, one
thread each; NCCL on GPUs) and prints rank 0's table. The model is a Qwen2-style one built
from a config (the embedded model widened: ``--hidden``/32 heads, half as many key/value
heads, ``--layers``, ``--vocab``), FSDP2-sharded over both ranks, fp32, with the trainer's
packed ``klppo_varlen`` attention. For each length L, one sequence of L tokens
(``--prompt-share`` of it prompt, default 1/8: a reasoning model's long response) goes
through the trainer's own update path (:func:`klppo_train.workers.forward.response_logprobs`
with entropy, a token-mean policy-style loss, backward):

- ``sp=1``: data parallelism: each rank updates on its own sequence (the whole row);
- ``sp=2``: both ranks hold the same sequence and each runs half of the packed row
  (attention on whole sequences for half the heads, the logits of half the tokens).

Columns: time of the update (slowest rank) and peak memory growth over the pass (largest
rank: RSS high-water mark on CPU, ``max_memory_allocated`` on CUDA; the trainer's probe
meter, :class:`klppo_train.trainer.measure.PassMeter`), and sp=2 / sp=1. A warm-up pass at
the smallest length comes first. On CPU the workers run with glibc's
``MALLOC_MMAP_THRESHOLD_`` fixed (``--mmap-threshold``, 128 KiB): every block from 128 KiB
up is mapped on its own and returned when freed, so the RSS peak follows the live tensors,
as CUDA's counter does. With glibc's default (a threshold that rises to 32 MiB as large
blocks are freed) freed mid-size blocks stay in the heap and count as resident: sp = 2's
many half-size tensors then look like a part of memory that does not split (2026-12-03, 2
ranks, 4096 and 8192 tokens: sp2/sp1 0.60-0.64 with the default, 0.52 with 128 KiB).

Then the trainer itself (``--trainer-response``, 0 to skip): one PPO step of the embedded
default (briefly warmed up, its context raised) under torchrun on 2 ranks, every token
budget ``auto``, responses up to ``--trainer-response`` tokens, under a
``trainer.memory_limit_gib`` that leaves each rank 0.8× what one full-length sequence
needs at sp = 1 (measured by a first run; ``--memory-limit-gib`` sets it), at sp = 1 and
sp = 2: sp = 1 is refused before step 0 (the probe's message), sp = 2 trains.
Writes ``benchmarks/results/ulysses_bench.json``.
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

from _results import RESULTS_DIR, write_results

RESULTS = RESULTS_DIR / "ulysses_bench.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,4096,8192", help="tokens per sequence")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument(
        "--prompt-share", type=float, default=0.125, help="of each sequence (the rest: response)"
    )
    parser.add_argument(
        "--trainer-response", type=int, default=16384, help="0: no trainer runs (below)"
    )
    parser.add_argument("--memory-limit-gib", type=float, default=0.0, help="0: calibrated")
    parser.add_argument(
        "--mmap-threshold", type=int, default=131072, help="glibc's, bytes (CPU); 0: its default"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build(args: argparse.Namespace, longest: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fsdp_sharding import ShardingConfig, default_device, shard_model
    from klppo_train.runtime.packed_attention import VARLEN

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 32,
        num_key_value_heads=max(1, args.hidden // 64),
        max_position_embeddings=longest,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).to(default_device())
    model.set_attn_implementation(VARLEN)
    return shard_model(model, ShardingConfig())


def update(model, length: int, vocab: int, seed: int, sp, prompt_share: float) -> None:
    """One update of one sequence: ``[1, L]``, ``prompt_share`` of it prompt."""
    import torch

    from fsdp_sharding import default_device
    from klppo_train.workers.forward import response_logprobs

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, length), generator=generator).to(default_device())
    mask = torch.ones_like(ids)
    response = length - int(length * prompt_share)
    logprobs, entropy = response_logprobs(
        model, ids, mask, response, max_tokens=None, with_entropy=True, sp=sp
    )
    loss = -(logprobs.mean() + 0.01 * entropy.mean())
    loss.backward()
    model.zero_grad(set_to_none=True)


def measure(model, length: int, args: argparse.Namespace, sp, rank: int) -> dict:
    import torch.distributed as dist

    from klppo_train.trainer.measure import PassMeter, agree

    seed = rank if sp.size == 1 else 0  # data parallel: own sequences; sp: the same one
    dist.barrier()
    run = lambda: update(model, length, args.vocab, seed, sp, args.prompt_share)  # noqa: E731
    point = agree(PassMeter()(run, length))
    return {"sp": sp.size, "length": length, "seconds": point.seconds, "peak_gib": point.memory_gib}


def worker(folder: Path) -> None:
    import torch
    import torch.distributed as dist

    from fsdp_sharding import default_device
    from klppo_train.runtime.sequence_parallel import SequenceParallel, sequence_parallel

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    args = argparse.Namespace(**json.loads((folder / "args.json").read_text()))
    lengths = [int(n) for n in args.lengths.split(",")]
    rank = dist.get_rank()
    model = build(args, max(lengths))
    splits = (SequenceParallel(), sequence_parallel(2))
    for sp in splits:  # warm-up: kernels, the allocator's first growth
        update(model, min(lengths), args.vocab, 0, sp, args.prompt_share)
    rows = [measure(model, n, args, sp, rank) for n in lengths for sp in splits]
    if rank == 0:
        result = {
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "backend": dist.get_backend(),
            "world_size": dist.get_world_size(),
            "threads_per_rank": torch.get_num_threads(),
            "torch": torch.__version__,
            "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab},
            "prompt_share": args.prompt_share,
            "params": sum(p.numel() for p in model.parameters()) * dist.get_world_size(),
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default"),
            "device_type": default_device().type,
            "rows": rows,
        }
        (folder / "result.json").write_text(json.dumps(result, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def launch(args: argparse.Namespace, folder: Path) -> dict:
    """The workers under torchrun (2 processes, a thread each on CPU); rank 0's result."""
    (folder / "args.json").write_text(json.dumps({k: v for k, v in vars(args).items() if k in (
        "lengths", "hidden", "layers", "vocab", "prompt_share")}))  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if args.mmap_threshold:  # RSS then follows the live tensors (the module docstring)
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    run = subprocess.run([*cmd, str(Path(__file__).resolve()), "--worker", str(folder)], env=env)
    if run.returncode != 0:
        raise SystemExit(f"ulysses_bench: torchrun failed with exit code {run.returncode}")
    return json.loads((folder / "result.json").read_text())


def _trainer_inputs(folder: Path) -> tuple[Path, Path]:
    """The embedded model, warmed up briefly (it answers and stops: short rollouts), its
    context raised for long sequences (Qwen2's rotary positions have no table), and data."""
    from klppo_train.data.datasets import write_parquet
    from klppo_train.demo.embedded import embedded_model
    from klppo_train.demo.tasks import COMPACT, make_arithmetic_rows

    rows = make_arithmetic_rows(2000, seed=0, template=COMPACT)
    model = embedded_model(
        folder / "model", train_rows=rows, warmup_steps=20, target_accuracy=0.25, seed=1
    )
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 65536}))
    write_parquet(rows, folder / "train.parquet")
    return model, folder / "train.parquet"


def _one_step(args, folder: Path, name: str, sp: int, limit_gib: float) -> dict:
    """One PPO step of the embedded default under torchrun (2 ranks), every token budget
    ``auto``; whether it trained (and the budgets and probe it chose) or the refusal."""
    model, data = folder / "model", folder / "train.parquet"
    run = folder / name
    roles = (("actor", "ppo"), ("critic", "ppo"), ("ref", "log_prob"), ("rollout", "log_prob"))
    overrides = [
        str(Path(__file__).resolve().parents[1] / "apps/train/recipes/default.yaml"),
        f"trainer.run_dir={run}", f"model.path={model}", f"data.train_files=[{data}]",
        f"data.val_files=[{data}]", "trainer.total_training_steps=1", "trainer.test_freq=0",
        "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.logger=file",
        "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
        "rollout.n=2", "rollout.engine=hf", f"rollout.response_length={args.trainer_response}",
        "model.share_prompts=false", f"actor.ulysses_sequence_parallel_size={sp}",
        f"trainer.memory_limit_gib={limit_gib:.3f}",
        *(f"{role}.{key}_max_token_len_per_gpu=auto" for role, key in roles),
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*cmd, "-m", "klppo_train", *overrides], capture_output=True, text=True, env=env
    )
    errors = [line for line in done.stderr.splitlines() if "klppo-train: error" in line]
    trained = (run / "metrics.jsonl").is_file()
    budgets = json.loads((run / "budgets.json").read_text()) if trained else {}
    return {"sp": sp, "limit_gib": limit_gib, "trained": trained,
            "budgets": budgets.get("tokens"), "probe": budgets.get("probe"),
            "refusal": errors[0] if errors else None}  # fmt: skip


def trainer_runs(args: argparse.Namespace, folder: Path) -> list[dict]:
    """The trainer's probe at sp = 1 and 2 (``--trainer-response``-token responses): a
    first sp = 1 run under no real limit measures what one full-length sequence needs (the
    largest role's) and the memory in use; the limit is then set where a rank may add 0.8×
    that (``--memory-limit-gib`` overrides it), and the step runs at sp = 1 and sp = 2."""
    _trainer_inputs(folder)
    limit = args.memory_limit_gib
    if not limit:
        probe = _one_step(args, folder, "calibration", 1, 1024.0)["probe"]
        need = max(role["points"][0]["memory_gib"] for role in probe["roles"].values())
        memory = probe["memory"]
        limit = memory["in_use_gib"] + memory["ranks_sharing"] * 0.8 * need
    return [_one_step(args, folder, f"sp{sp}", sp, limit) for sp in (1, 2)]


def print_table(data: dict) -> None:
    m = data["model"]
    print(
        f"{data['device']} ({data['backend']}), {data['world_size']} ranks × "
        f"{data['threads_per_rank']} threads, torch {data['torch']}; Qwen2 "
        f"{data['params'] / 1e6:.1f}M params (hidden {m['hidden']}, {m['layers']} layers, "
        f"vocab {m['vocab']}), FSDP2 over both ranks, one sequence per update, "
        f"{data['prompt_share']:.0%} of it prompt; MALLOC_MMAP_THRESHOLD_ "
        f"{data.get('malloc_mmap_threshold')}"
    )
    print("| tokens | sp=1 s | sp=2 s | sp=1 peak GiB | sp=2 peak GiB | memory sp2/sp1 |")
    print("|-------:|-------:|-------:|--------------:|--------------:|---------------:|")
    rows = {(r["length"], r["sp"]): r for r in data["rows"]}
    for length in sorted({r["length"] for r in data["rows"]}):
        one, two = rows[length, 1], rows[length, 2]
        data.setdefault("ratios", {})[str(length)] = two["peak_gib"] / max(one["peak_gib"], 1e-9)
        print(
            f"| {length:>6} | {one['seconds']:>6.2f} | {two['seconds']:>6.2f} | "
            f"{one['peak_gib']:>13.3f} | {two['peak_gib']:>13.3f} | "
            f"{data['ratios'][str(length)]:>14.2f} |"
        )


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args.worker)
        return
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        data = launch(args, Path(tmp))
        if args.trainer_response:
            data["trainer"] = trainer_runs(args, Path(tmp))
    data["wall_s"] = time.perf_counter() - start
    print_table(data)
    for row in data.get("trainer", []):
        outcome = f"trained, budgets {row['budgets']}" if row["trained"] else row["refusal"]
        print(
            f"trainer, response {args.trainer_response} tokens, memory limit "
            f"{row['limit_gib']:.2f} GiB, sp={row['sp']}: {outcome}"
        )
    print(f"wall time {data['wall_s']:.0f} s")
    write_results(data, args.out)


if __name__ == "__main__":
    main()
