"""LoRA weight sync: the trainer sends only the adapters; the engine's weights become
``W + (α/r)·B·A`` with ``W`` read from the base model directory the engine started from.

Why merge rather than vLLM's LoRA kernels: a merged engine generates at the base model's
speed (no per-token adapter matmuls), any engine that loads HF-named weights (vLLM, HF)
takes it, and the base weights are never re-sent by the trainer -- only ``A`` and ``B``
(a few percent of the model at ranks 8-64). The base tensors come from the directory's
safetensors (memory-mapped, one at a time).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from rollout.protocol import RolloutEngine

ADAPTER_PARTS = {"lora_A": "A", "lora_B": "B"}


def adapter_module(name: str) -> tuple[str, str]:
    """A peft adapter tensor's name → ``(HF module name, "A" | "B")``:
    ``base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight`` →
    ``("model.layers.0.mlp.up_proj", "A")``."""
    parts = name.split(".")
    where = [i for i, part in enumerate(parts) if part in ADAPTER_PARTS]
    if not where or parts[-1] != "weight" or len(parts) - where[-1] != 3:
        raise ValueError(f"{name!r} is not a LoRA adapter weight (…lora_A|lora_B.<name>.weight)")
    module = parts[: where[-1]]
    if module[:2] == ["base_model", "model"]:
        module = module[2:]
    return ".".join(module), ADAPTER_PARTS[parts[where[-1]]]


class BaseWeights:
    """The tensors of a HF model directory's safetensors files, by name, memory-mapped
    (one file open at a time per lookup), in the files' order."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = sorted(set(weight_map.values()))
        else:
            self.files = ["model.safetensors"]
        if not all((self.model_dir / f).is_file() for f in self.files):
            raise FileNotFoundError(f"no safetensors weights in {self.model_dir}")

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in self.files:
            with safe_open(self.model_dir / file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    yield name, f.get_tensor(name)


def adapter_pairs(
    named: Iterable[tuple[str, torch.Tensor]],
) -> dict[str, dict[str, torch.Tensor]]:
    """peft-named adapter tensors → HF module name → ``{"A": [r, in], "B": [out, r]}``."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        module, part = adapter_module(name)
        pairs.setdefault(module, {})[part] = tensor
    return pairs


def merged_weights(
    adapters: dict[str, dict[str, torch.Tensor]],
    base: Iterable[tuple[str, torch.Tensor]],
    scaling: float,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every base weight, with ``scaling · B @ A`` added (in fp32) to each adapted module's
    ``weight``, cast to ``dtype`` (None: each base tensor's own).

    Args:
        adapters: HF module name → ``{"A": [r, in], "B": [out, r]}``.
        base: ``(hf_name, tensor)`` of the whole base model (:class:`BaseWeights`).
        scaling: ``lora_alpha / r``.
        dtype: the engine's weight dtype; None keeps the base's.
    """
    left = set(adapters)
    for name, tensor in base:
        module = name.removesuffix(".weight")
        out_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        if name.endswith(".weight") and module in adapters:
            pair = adapters[module]
            tensor = tensor.float() + scaling * (pair["B"].float() @ pair["A"].float())
            left.discard(module)
        yield name, tensor.to(out_dtype)
    if left:
        raise ValueError(f"adapted modules not in the base weights: {sorted(left)[:3]}")


class AdapterSync:
    """Push the trainer's current LoRA adapters into a rollout engine that started from the
    base model in ``base_dir``: the engine's weights become the merged ``W + (α/r)·B·A``.

    Ordering rules are :class:`rollout.WeightSync`'s: call :meth:`sync` after the
    optimizer step and before the next ``generate``; every trainer rank calls it (the
    adapter iterator is a collective per tensor, walked to the end in the same order);
    ranks without an engine pass ``engine=None`` and only drain the iterator; versions
    increase. The adapters are cast to ``dtype`` as they stream (the trainer computes them
    in that dtype too); ``rollout/weight_sync_bytes`` counts what the trainer sent (the
    adapters), not the base weights the engine reads back from its own directory.

    Args:
        named_adapters: returns a fresh ``(peft_name, tensor)`` iterator of the adapters.
        engine: the engine this rank feeds, or ``None``.
        base_dir: the HF directory the engine was started from.
        scaling: ``lora_alpha / lora_rank``.
        dtype: the engine's weight dtype.
    """

    def __init__(
        self,
        named_adapters: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        engine: RolloutEngine | None,
        base_dir: str | Path,
        scaling: float,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.named_adapters = named_adapters
        self.engine = engine
        self.base = BaseWeights(base_dir)
        self.scaling = scaling
        self.dtype = dtype
        self.version = engine.policy_version if engine is not None else 0
        self.metrics: dict[str, float] = {}

    def sync(self, version: int) -> dict[str, float]:
        """Gather the adapters, merge them into the engine; ``timing_s/update_weights`` and
        the bytes sent."""
        if version <= self.version:
            raise ValueError(
                f"AdapterSync.sync(version={version}): must exceed the last version {self.version}"
            )
        start = time.perf_counter()
        received, sent = [], 0
        for name, tensor in self.named_adapters():
            tensor = tensor.to(self.dtype) if self.dtype is not None else tensor
            sent += tensor.numel() * tensor.element_size()
            if self.engine is not None:  # a rank without an engine keeps nothing
                received.append((name, tensor))
        if self.engine is not None:
            adapters = adapter_pairs(received)
            weights = merged_weights(adapters, self.base, self.scaling, self.dtype)
            self.engine.update_weights(weights, version=version)
        self.version = version
        self.metrics = {
            "timing_s/update_weights": time.perf_counter() - start,
            "rollout/weight_sync_bytes": float(sent),
        }
        return self.metrics
