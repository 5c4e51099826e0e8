"""Choose the shard units: which submodules get their own FSDP all-gather/reshard."""

from __future__ import annotations

from torch import nn

from fsdp_sharding.config import ShardingConfig


def _class_names(model: nn.Module) -> list[str]:
    return sorted({type(m).__name__ for m in model.modules()})


def units_by_class(model: nn.Module, class_names: tuple[str, ...]) -> list[nn.Module]:
    """Modules whose class name is in ``class_names``, outermost only, in module order."""
    units: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or module is model:
            continue
        if type(module).__name__ in class_names:
            units.append(module)
            inside.update(id(m) for m in module.modules())
    if not units:
        raise ValueError(
            f"wrap policy matched no module: looked for {list(class_names)}; the model has "
            f"{_class_names(model)}"
        )
    return units


# Containers without a forward of their own cannot be shard units (fully_shard refuses
# them, as torch's size_based_auto_wrap_policy excludes them): their parameters count
# towards the parent instead.
CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def units_by_size(model: nn.Module, min_num_params: int) -> list[nn.Module]:
    """Bottom-up: a module becomes a unit once its not-yet-wrapped parameters reach the bound
    (``ModuleList``/``ModuleDict`` never do: their parameters move up to the parent)."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        remaining = sum(visit(child) for child in module.children())
        remaining += sum(p.numel() for p in module.parameters(recurse=False))
        unit = module is not model and not isinstance(module, CONTAINERS)
        if unit and remaining >= min_num_params:
            units.append(module)
            return 0
        return remaining

    visit(model)
    if not units:
        raise ValueError(f"min_num_params={min_num_params} matched no module below the root")
    return units


def untied_embeddings(model: nn.Module) -> list[nn.Module]:
    """Input and output embeddings as their own units, unless they share the weight."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return []
    emb_in, emb_out = get_in(), get_out()
    if emb_in is None or emb_out is None or emb_in.weight is emb_out.weight:
        return []  # tied: one parameter, which must stay with the root
    return [emb_in, emb_out]


def choose_shard_units(model: nn.Module, config: ShardingConfig) -> list[nn.Module]:
    """Shard units in forward order (embeddings first, layers, output head last); the root
    is not included — it is wrapped after all of them."""
    if config.min_num_params is not None:
        return units_by_size(model, config.min_num_params)
    names = config.wrap_policy or tuple(getattr(model, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(
            "ShardingConfig.wrap_policy is not set and the model has no _no_split_modules; "
            f"name the classes to shard (the model has {_class_names(model)})"
        )
    layers = units_by_class(model, tuple(names))
    embeddings = untied_embeddings(model)
    if not embeddings:
        return layers
    return [embeddings[0], *layers, embeddings[1]]
