"""A sharded model from scratch: rank 0 initializes a piece at a time and scatters it.

For code inside the ranks (it imports torch). Rank 0 runs each module's own
``reset_parameters()`` (for a model with its own ``_init_weights``, as Hugging Face's
are, one unit at a time and that init over the unit's modules, children first, as
``post_init`` does) in the order the model registered its modules, under the seed, and
scatters each parameter to its shards; no rank holds more than its shard and one module
(one unit). A parameter that no initializer writes stays NaN and is named.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nbshard.rank.scatter import scatter_into

__all__ = ["init_from_rank0"]


def _initializer(template: nn.Module) -> Callable[[nn.Module], None] | None:
    """How a module of this model initializes itself: a Hugging Face model through its own
    ``_init_weights`` (which sets what its layers' ``reset_parameters`` would not), else None."""
    init_weights = getattr(template, "_init_weights", None)
    if not callable(init_weights):
        return None
    try:
        inspect.signature(init_weights).bind(template)  # takes a module: HF's (and nanoGPT's) convention
    except (TypeError, ValueError):
        return None
    return init_weights


def _init_groups(template: nn.Module, units: Sequence[Sequence[nn.Module]], whole_units: bool) -> list[list[nn.Module]]:
    """The modules rank 0 initializes together, in the order the model registers them: each module
    alone, or with ``whole_units`` each unit's modules together (a model's own init may set a
    descendant's parameters: GPT-2's attention and MLP scale their ``c_proj``)."""
    if not whole_units:
        return [[module] for module in template.modules()]
    unit_of: dict[int, int] = {}
    for index, unit in enumerate(units):
        for root in unit:
            unit_of.update((id(module), index) for module in root.modules())
    groups: list[list[nn.Module]] = []
    started: dict[int, list[nn.Module]] = {}
    for module in template.modules():
        unit_index = unit_of.get(id(module))
        if unit_index is None:
            groups.append([module])
        elif unit_index in started:
            started[unit_index].append(module)
        else:
            started[unit_index] = [module]
            groups.append(started[unit_index])
    return groups


def init_from_rank0(
    model: nn.Module, template: nn.Module, seed: int, only: set[str] | None = None, units: Sequence[Sequence[nn.Module]] = ()
) -> None:
    """Rank 0 initializes one module (or, for a model with its own ``_init_weights``, one unit) at a
    time and scatters it (``only``: just those keys)."""
    rank = dist.get_rank()
    targets = dict(model.named_parameters(remove_duplicate=False))
    # A persistent buffer the checkpoint lacks keeps the value the model was built with.
    wanted = {id(targets[name]) for name in only if name in targets} if only is not None else set(map(id, targets.values()))
    init_weights = _initializer(template)
    names_of = {id(module): {name: f"{prefix}.{name}" if prefix else name for name, _ in module.named_parameters(recurse=False)}
                for prefix, module in template.named_modules()}
    template_units = _same_modules_in(template, model, units)
    groups = _init_groups(template, template_units, whole_units=init_weights is not None)
    done: set[int] = set()
    uninitialized: list[str] = []  # rank 0's: parameters no initializer wrote
    # After the last group that first owns a wanted parameter, only tied copies remain (a tied head):
    # initializing them would change nothing but hold a whole module on rank 0.
    first_owners = {id(targets[key]): index for index, group in reversed(list(enumerate(groups)))
                    for module in group for key in names_of[id(module)].values()}
    last = max((index for target, index in first_owners.items() if target in wanted), default=-1)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for group in groups[: last + 1]:
            keys = [key for module in group for key in names_of[id(module)].values()]
            if not any(id(targets[key]) in wanted for key in keys):
                continue
            if init_weights is None and not hasattr(group[0], "reset_parameters"):
                continue
            if rank == 0:  # draws in the order construction would have
                uninitialized += _initialize(group, names_of, init_weights)
            for module in group:
                for name, key in names_of[id(module)].items():
                    target = targets[key]
                    if id(target) in done or id(target) not in wanted:  # a tied parameter keeps its first owner's values
                        continue
                    source: Any = module._parameters[name]
                    scatter_into(target, source.detach() if rank == 0 else None)
                    done.add(id(target))
            for module in group:
                module.to_empty(device="meta", recurse=False)  # rank 0 lets go of them
    left = sorted(name for name, param in targets.items() if id(param) in wanted and id(param) not in done)
    shared: list[Any] = [uninitialized]
    dist.broadcast_object_list(shared, src=0)
    left += shared[0]
    if left:
        raise ValueError(
            f"no reset_parameters() initializes {', '.join(left[:10])}: their modules define none. "
            "Give those modules a reset_parameters(), or load a checkpoint (full_checkpoint=...)."
        )


def _initialize(group: list[nn.Module], names_of: dict[int, dict[str, str]], init_weights: Callable[[nn.Module], None] | None) -> list[str]:
    """On rank 0: allocate the group's parameters and run the model's own init over them, as
    construction and then ``post_init`` would: each module's ``reset_parameters()`` in registration
    order, then ``init_weights`` children before parents (``nn.Module.apply``'s order). Returns the
    keys of parameters no initializer wrote."""
    materialized: list[tuple[str, torch.Tensor]] = []
    for module in group:
        module.to_empty(device="cpu", recurse=False)
        for name, key in names_of[id(module)].items():
            param: Any = module._parameters[name]  # registered: the template names only parameters it has
            if param.is_floating_point():
                param.fill_(float("nan"))  # what no initializer writes stays NaN, and is named
            materialized.append((key, param))
    for module in group:
        if callable(reset := getattr(module, "reset_parameters", None)):
            reset()
    if init_weights is not None:
        for module in reversed(group):  # a module comes after its parent in registration order
            init_weights(module)
    # A sum is NaN when any element is; it allocates no tensor of the parameter's size.
    return [key for key, param in materialized if param.is_floating_point() and param.sum().isnan()]


def _same_modules_in(template: nn.Module, model: nn.Module, units: Sequence[Sequence[nn.Module]]) -> list[list[nn.Module]]:
    """``units`` (modules of ``model``) as the modules of ``template``, its copy, at the same names."""
    name_of = {id(module): name for name, module in model.named_modules()}
    in_template = dict(template.named_modules())
    return [[in_template[name_of[id(module)]] for module in unit] for unit in units]
