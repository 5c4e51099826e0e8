"""Multi-turn rollouts on vLLM: generated tokens/s with the prefix cache on and off, and what
a turn costs against a single-turn rollout of the same total length.

    uv run --no-sync python benchmarks/multi_turn_bench.py [--conversations 32] [--turns 4]
        [--turn-tokens 32] [--prompt-len 384] [--hidden 768] [--layers 12]

A Qwen2-style model is built from a config (seeded, no download; defaults: hidden 768, 12
layers, 12 heads of 64, 2 KV heads, MLP 1536, 60M parameters with the 384-token vocabulary
of the tool demo's byte-level ChatML tokenizer ``klppo_train.demo.tool_use.tool_tokenizer``)
and saved once. Each configuration runs in its own child process with its own engine
(``--prefix-cache on`` / ``off``), on the same ``--conversations`` random prompts of
``--prompt-len`` tokens:

- **multi-turn**: :class:`rollout.MultiTurnRollout` over ``--turns`` assistant turns of
  exactly ``--turn-tokens`` generated tokens each (the engine is capped per turn; EOS is
  ignored), each followed by a scripted user turn of ``--user-tokens`` tokens rendered by the
  chat template and appended; one engine call per turn, each turn's prompt the whole history.
- **single-turn**: one ``generate`` of the same total response length (every generated and
  appended token of the multi-turn response decoded), same prompts.

The prefix cache is emptied before each of the two, so neither reuses the other's blocks.

Reported per configuration: the multi-turn wall seconds and generated tokens/s, vLLM's
prefix-cache hit rate over the multi-turn calls (hits / queried prompt tokens), the prompt
tokens vLLM computed (prefilled, not from the cache), the single-turn wall seconds, the
ratio multi / single, and the cost of a turn boundary ``(multi - single) / (turns - 1)``.
A random model writes random tokens; only the shapes matter here. Absolute numbers on a
shared 2-core VM move by ±30 %; compare the ratios. Prints a markdown table and writes
``benchmarks/results/multi_turn_bench.json`` (atomically).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from _results import RESULTS_DIR, write_results

RESULTS = RESULTS_DIR / "multi_turn_bench.json"
USER_TEXT = "Go on, please continue with your answer and tell me more about it. "


class TurnCapped:
    """``engine`` with every turn cut at ``turn_tokens`` generated tokens; a turn cut there
    ends as ``stop`` (the conversation goes on) unless its own budget ended it."""

    def __init__(self, engine, turn_tokens: int) -> None:
        self.engine, self.turn_tokens = engine, turn_tokens

    def generate(self, prompts, sampling, *, seeds=None, max_new_tokens=None):
        budgets = list(max_new_tokens or [sampling.max_new_tokens] * len(prompts))
        caps = [min(self.turn_tokens, b) for b in budgets]
        batch = self.engine.generate(
            prompts,
            replace(sampling, max_new_tokens=min(self.turn_tokens, sampling.max_new_tokens)),
            seeds=seeds,
            max_new_tokens=caps if max_new_tokens is not None else None,
        )
        samples = [
            replace(s, finish_reason="stop") if budgets[s.prompt_index] > self.turn_tokens else s
            for s in batch.samples
        ]
        return replace(batch, samples=samples)


class ScriptedUser:
    """An environment that always answers with the same user turn (no tool calls)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def wants_turn(self, text, context) -> bool:
        return True

    def respond(self, texts, contexts):
        from rollout import Observation

        return [Observation(({"role": "user", "content": self.text},)) for _ in texts]


def build_model_dir(args: argparse.Namespace, path: Path):
    """Save the tokenizer and a seeded random Qwen2-style model at ``path``; return the
    tokenizer and the user turn's text (``--user-tokens`` long once rendered)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from klppo_train.demo.tool_use import tool_tokenizer
    from rollout import TurnRenderer

    tokenizer = tool_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.kv_heads,
        head_dim=64,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    Qwen2ForCausalLM(config).float().save_pretrained(path)
    tokenizer.save_pretrained(path)
    renderer, text = TurnRenderer(tokenizer), USER_TEXT
    while len(renderer.ids([{"role": "user", "content": text}])) < args.user_tokens:
        text += USER_TEXT
    while len(renderer.ids([{"role": "user", "content": text}])) > args.user_tokens:
        text = text[:-1]
    return tokenizer, text


def child(args: argparse.Namespace) -> dict:
    """One configuration: its engine, the multi-turn then the single-turn rollout."""
    from transformers import AutoConfig, AutoTokenizer

    from rollout import (
        MultiTurnConfig,
        MultiTurnRollout,
        SamplingConfig,
        TurnRenderer,
        VLLMConfig,
        VLLMEngine,
    )

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    text = Path(args.model_dir, "user_turn.txt").read_text()
    n, turns, g = args.conversations, args.turns, args.turn_tokens
    renderer = TurnRenderer(tokenizer)
    appended = len(renderer.ids([{"role": "user", "content": text}]))
    total = turns * g + (turns - 1) * appended
    config = VLLMConfig(
        dtype="float32",
        max_model_len=args.prompt_len + total + 8,
        max_num_seqs=n,
        kv_cache_space_gib=args.kv_cache_gib,
        enable_prefix_caching=args.prefix_cache == "on",
        disable_log_stats=False,
    )
    engine = VLLMEngine(args.model_dir, config)
    gen = torch.Generator().manual_seed(1)
    vocab = AutoConfig.from_pretrained(args.model_dir).vocab_size  # the model's ids
    prompts = torch.randint(3, vocab, (n, args.prompt_len), generator=gen).tolist()
    warmup = torch.randint(3, vocab, (2, args.prompt_len), generator=gen).tolist()
    sampling = SamplingConfig(max_new_tokens=total, ignore_eos=True, seed=0)
    engine.generate(warmup, replace(sampling, max_new_tokens=4))

    decode = lambda ids: tokenizer.decode(list(ids))  # noqa: E731
    rollout = MultiTurnRollout(
        TurnCapped(engine, g),
        renderer,
        decode,
        {"tool_agent": ScriptedUser(text)},
        MultiTurnConfig(max_assistant_turns=turns),
    )
    engine.llm.reset_prefix_cache()  # the warm-up's blocks: neither rollout starts with any
    before = engine.stats()
    start = time.perf_counter()
    batch = rollout.generate(prompts, sampling)
    multi_s = time.perf_counter() - start
    after = engine.stats()
    lengths = {len(s.response_token_ids) for s in batch.samples}
    generated = sum(sum(s.loss_mask) for s in batch.samples)
    if lengths != {total} or generated != n * turns * g:
        raise RuntimeError(f"expected {total}-token responses, {turns}x{g} generated: {lengths}")
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    prompt_tokens = after["prompt_tokens"] - before["prompt_tokens"]

    engine.llm.reset_prefix_cache()  # else the multi-turn run's prompt blocks serve it
    start = time.perf_counter()
    single = engine.generate(prompts, sampling)
    single_s = time.perf_counter() - start
    if {len(s.response_token_ids) for s in single.samples} != {total}:
        raise RuntimeError("the single-turn rollout did not generate the full length")
    engine.close()
    return {
        "prefix_cache": args.prefix_cache,
        "response_tokens": total,
        "appended_per_turn": appended,
        "multi_turn_s": multi_s,
        "generated_tokens": generated,
        "generated_tokens_per_s": generated / multi_s,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "prefilled_tokens": prompt_tokens - hits,
        "single_turn_s": single_s,
        "single_turn_tokens_per_s": n * total / single_s,
        "multi_over_single": multi_s / single_s,
        "turn_boundary_s": (multi_s - single_s) / max(turns - 1, 1),
        "threads": torch.get_num_threads(),
    }


def run_child(args: argparse.Namespace, model_dir: str, prefix_cache: str) -> dict:
    out = Path(model_dir) / f"result_{prefix_cache}.json"
    cmd = [sys.executable, __file__, "--child", "--model-dir", model_dir, "--out", str(out)]
    cmd += ["--prefix-cache", prefix_cache, *forwarded(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"prefix cache {prefix_cache}: child failed\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def forwarded(args: argparse.Namespace) -> list[str]:
    keys = ("conversations", "turns", "turn_tokens", "user_tokens", "prompt_len", "kv_cache_gib")
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]


def print_table(result: dict, args: argparse.Namespace) -> None:
    r = result["configs"]
    print(
        f"\nQwen2-style {result['params'] / 1e6:.0f}M params (hidden {args.hidden}, "
        f"{args.layers} layers), float32, vLLM; {args.conversations} conversations, prompt "
        f"{args.prompt_len} tokens, {args.turns} turns x {args.turn_tokens} generated + "
        f"{r['on']['appended_per_turn']}-token user turns = {r['on']['response_tokens']}-token "
        "responses\n"
    )
    print("| prefix cache | multi-turn s | generated tok/s | cache hit rate | prefilled tokens "
          "| single-turn s | multi / single | s per turn boundary |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name in ("on", "off"):
        c = r[name]
        print(
            f"| {name} | {c['multi_turn_s']:.2f} | {c['generated_tokens_per_s']:.0f} | "
            f"{c['prefix_cache_hit_rate']:.2f} | {c['prefilled_tokens']} | "
            f"{c['single_turn_s']:.2f} | {c['multi_over_single']:.2f} | "
            f"{c['turn_boundary_s']:+.2f} |"
        )
    print(f"\nprefix cache on vs off, multi-turn: {result['on_speedup']:.2f}x")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=32, help="prompts, one conversation each")
    p.add_argument("--turns", type=int, default=4, help="assistant turns per conversation")
    p.add_argument("--turn-tokens", type=int, default=32, help="generated tokens per turn")
    p.add_argument("--user-tokens", type=int, default=32, help="tokens per appended user turn")
    p.add_argument("--prompt-len", type=int, default=384, help="tokens per prompt")
    p.add_argument("--hidden", type=int, default=768, help="model width (heads of 64)")
    p.add_argument("--layers", type=int, default=12, help="decoder layers")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--intermediate", type=int, default=1536, help="MLP width")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="vLLM KV cache (GiB)")
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON file to write")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--prefix-cache", choices=("on", "off"), default="on", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        write_results(child(args), args.out)
        return
    wall = time.perf_counter()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}")
    with tempfile.TemporaryDirectory(prefix="multi_turn_bench_") as model_dir:
        tokenizer, text = build_model_dir(args, Path(model_dir))
        Path(model_dir, "user_turn.txt").write_text(text)
        params = sum(t.numel() for t in _weights(model_dir))
        configs = {name: run_child(args, model_dir, name) for name in ("on", "off")}
    result = {
        "params": params,
        "configs": configs,
        "on_speedup": configs["off"]["multi_turn_s"] / configs["on"]["multi_turn_s"],
        "wall_s": time.perf_counter() - wall,
        "torch": torch.__version__,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    print_table(result, args)
    print(f"\nwall {result['wall_s']:.0f} s")
    write_results(result, args.out)


def _weights(model_dir: str):
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors")).values()


if __name__ == "__main__":
    main()
