"""Rollout engines side by side: vLLM vs HF generate tokens/s, and vLLM weight-sync seconds.

    uv run --no-sync python benchmarks/rollout_bench.py [--num-seqs 256] [--new-tokens 64]
        [--hidden 768] [--layers 12] [--vocab 32000]

One process, one model, one prompt set. A Qwen2-style model is built from a config (seeded, no
download; defaults 108M parameters: hidden 768, 12 layers, 12 heads of 64, 2 KV heads, MLP
1536, vocab 32000, untied lm_head) and saved to a temporary directory for vLLM; the same model
serves both the generation and the weight-sync parts. Both engines
generate ``--num-seqs`` responses of exactly ``--new-tokens`` tokens (``ignore_eos=True``,
temperature 1) from the same random prompts of ``--prompt-len`` tokens, in one ``generate``
call each (HF's ``max_tokens_per_batch`` is raised so all rows go into one batch, as vLLM's
``max_num_seqs`` lets them).
Then the model is perturbed and pushed into the running vLLM engine with
``VLLMEngine.update_weights(model.named_parameters())`` ``--sync-repeats`` times (median
reported), and the engine's log-probs are checked against an HF recompute on the new weights
(``logprob_max_diff``: ~1e-6 when the sync is right; ``--tie-embeddings`` exercises the
tied-embedding path).

Threads: HF runs first, before vLLM is imported, with the process's OpenMP threads as they are
(``torch.get_num_threads()`` is printed). The vLLM engine runs in-process and binds its own
OpenMP threads (it then turns ``torch.set_num_threads`` into a no-op for the whole process),
which is why HF goes first. ``shared/notes/vllm-cpu.md`` found ``OMP_NUM_THREADS=1`` sometimes
faster under contention on the shared 2-core VMs; set it in the environment to compare.
Absolute numbers on a shared 2-core VM move by ±30 %; the ratio is what to compare.

Prints a markdown table and writes ``benchmarks/results/rollout_bench.json`` (atomically).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _results import RESULTS_DIR, write_results
from transformers import Qwen2Config, Qwen2ForCausalLM

from rollout import HFEngine, HFEngineConfig, SamplingConfig

ROOT = Path(__file__).resolve().parents[1]
RESULTS = RESULTS_DIR / "rollout_bench.json"
EOS, PAD = 1, 0


def build_model(args: argparse.Namespace) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or round(8 * args.hidden / 3 / 64) * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // args.head_dim,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=max(256, args.prompt_len + args.new_tokens),
        tie_word_embeddings=args.tie_embeddings,
        eos_token_id=EOS,
        bos_token_id=PAD,
    )
    return Qwen2ForCausalLM(config).float().eval()


def make_prompts(num: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(2, vocab, (num, length), generator=gen).tolist()


def timed_generate(engine, prompts, sampling: SamplingConfig, new_tokens: int) -> dict:
    start = time.perf_counter()
    batch = engine.generate(prompts, sampling)
    seconds = time.perf_counter() - start
    lengths = {len(s.response_token_ids) for s in batch.samples}
    if lengths != {new_tokens}:
        raise RuntimeError(f"expected {new_tokens} tokens per response, got lengths {lengths}")
    tokens = new_tokens * len(batch)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


@torch.no_grad()
def logprob_max_diff(model, prompts, batch) -> float:
    worst = 0.0
    for s in batch.samples:
        prompt = prompts[s.prompt_index]
        ids = torch.tensor([prompt + list(s.response_token_ids)])
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
        worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
    return worst


def run(args: argparse.Namespace) -> dict:
    model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    prompts = make_prompts(args.num_seqs, args.prompt_len, args.vocab)
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
    warmup = SamplingConfig(max_new_tokens=2, ignore_eos=True, seed=0)
    width = args.num_seqs * (args.prompt_len + args.new_tokens)  # HF: all rows in one call
    result = {"params": params, "num_seqs": args.num_seqs, "new_tokens": args.new_tokens}

    # HF first: the process's threads are untouched until vLLM starts.
    hf_threads = torch.get_num_threads()
    hf = HFEngine(
        model, HFEngineConfig(pad_token_id=PAD, eos_token_ids=(EOS,), max_tokens_per_batch=width)
    )
    hf.generate(prompts[:2], warmup)
    result["hf"] = {**timed_generate(hf, prompts, sampling, args.new_tokens), "threads": hf_threads}
    print(f"hf done: {result['hf']['tokens_per_s']:.0f} tokens/s", flush=True)

    os.environ.setdefault("VLLM_CACHE_ROOT", "/tmp/klppo_vllm_cache")
    from rollout import VLLMConfig, VLLMEngine  # vllm itself is imported by the engine

    with tempfile.TemporaryDirectory(prefix="rollout_bench_") as model_dir:
        model.save_pretrained(model_dir)
        start = time.perf_counter()
        engine = VLLMEngine(
            model_dir,
            VLLMConfig(
                dtype="float32",
                max_model_len=args.prompt_len + args.new_tokens,
                max_num_seqs=args.num_seqs,
                kv_cache_space_gib=args.kv_cache_gib,
            ),
        )
        start_s = time.perf_counter() - start
        engine.generate(prompts[:2], warmup)
        result["vllm"] = {
            **timed_generate(engine, prompts, sampling, args.new_tokens),
            "threads": torch.get_num_threads(),
            "start_s": start_s,
        }
        print(f"vllm done: {result['vllm']['tokens_per_s']:.0f} tokens/s", flush=True)

        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
        times = []
        for version in range(1, args.sync_repeats + 1):
            start = time.perf_counter()
            engine.update_weights(model.named_parameters(), version=version)
            times.append(time.perf_counter() - start)
        check_prompts = prompts[:4]
        check = engine.generate(check_prompts, SamplingConfig(max_new_tokens=8, seed=3))
        result["sync"] = {
            "seconds_median": statistics.median(times),
            "seconds": times,
            "bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "logprob_max_diff": logprob_max_diff(model, check_prompts, check),
        }
        result["sync"]["ok"] = result["sync"]["logprob_max_diff"] <= 1e-4
        engine.close()
    return result


def print_table(r: dict, args: argparse.Namespace) -> None:
    shape = (
        f"Qwen2-style {r['params'] / 1e6:.1f}M params (hidden {args.hidden}, {args.layers} layers,"
        f" vocab {args.vocab}), float32, {r['num_seqs']} seqs x {r['new_tokens']} new tokens,"
        f" prompt {args.prompt_len}"
    )
    print(f"\n{shape}\n")
    print("| engine | threads | generate s | tokens | tokens/s | vs HF |")
    print("|--------|---------|------------|--------|----------|-------|")
    for name in ("hf", "vllm"):
        e = r[name]
        print(
            f"| {name:<6} | {e['threads']:>7} | {e['seconds']:>10.2f} | {e['tokens']:>6} "
            f"| {e['tokens_per_s']:>8.0f} | {e['tokens_per_s'] / r['hf']['tokens_per_s']:>4.1f}x |"
        )
    s = r["sync"]
    print(
        f"\nvLLM start {r['vllm']['start_s']:.1f} s; weight sync (update_weights, "
        f"{s['bytes'] / 2**20:.0f} MiB, streamed): median "
        f"{s['seconds_median']:.2f} s of {len(s['seconds'])}; log-prob max diff after sync "
        f"{s['logprob_max_diff']:.1e}"
    )
    if not s["ok"]:
        print("WARNING: the engine's log-probs after the sync do not match the synced weights")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256, help="prompts, one response each")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per response")
    parser.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt")
    parser.add_argument("--hidden", type=int, default=768, help="model width")
    parser.add_argument("--layers", type=int, default=12, help="decoder layers")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    parser.add_argument("--head-dim", type=int, default=64, help="attention head size (>= 32)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    parser.add_argument("--intermediate", type=int, default=1536, help="MLP width; 0 = 8h/3")
    parser.add_argument(
        "--tie-embeddings", action="store_true", help="tie lm_head to the input embeddings"
    )
    parser.add_argument("--sync-repeats", type=int, default=3, help="timed weight syncs")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="vLLM KV cache (GiB)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON file to write")
    args = parser.parse_args()
    wall = time.perf_counter()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}")
    result = run(args)
    result["wall_s"] = time.perf_counter() - wall
    result["torch"] = torch.__version__
    result["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    print_table(result, args)
    print(f"\nwall {result['wall_s']:.0f} s")
    write_results(result, args.out)


if __name__ == "__main__":
    main()
