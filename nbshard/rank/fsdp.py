"""Only the shard in memory: build a model with FSDP2 so no rank ever holds a full copy.

For code running inside the ranks (it imports torch; ``import nbshard`` does not import it)::

    from nbshard.rank import fsdp

    model = fsdp.build_sharded(lambda: MyModel(cfg), full_checkpoint="base.pt")   # or sharded_checkpoint=...
    ...train...
    fsdp.save_sharded(model, "ckpt/")               # each rank writes its shards
    fsdp.save_full(model, "final.pt")               # rank 0 writes one plain state dict

``build_sharded`` builds the model with its parameters on the ``meta`` device
(buffers are built for real, so non-persistent ones such as rotary
``inv_freq`` come out right), applies ``fully_shard`` to each block and then
to the root, allocates only this rank's shard, and fills it:

- from a sharded ``torch.distributed.checkpoint`` directory: each rank reads
  only its own shards;
- from a full checkpoint that rank 0 alone reads, memory-mapped, one tensor
  at a time, sending each rank its rows (``_scatter_into``);
- from scratch: rank 0 initializes one module at a time with each module's own
  ``reset_parameters()`` in the order the model registers its modules, under
  ``seed``, and scatters it. With torch.nn's layers this makes the gathered
  model bit-for-bit equal to ``torch.manual_seed(seed); build()`` in one
  process (tied weights too, when the tie is made after the layers are built),
  while no rank holds more than its shard and one module. A parameter whose
  module has no ``reset_parameters()`` is an error that names it.

A vocabulary's embedding and head are not gathered whole but a chunk of rows at
a time (``nbshard.chunked``).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import os
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from nbshard.rank.checkpoints import Checkpoint, MappedReader, match_keys, model_keys, open_checkpoint
from nbshard.rank.chunked import can_chunk, row_span, shard_by_rows
from nbshard.rank.dist import device as rank_device
from nbshard.rank.full_checkpoint import write_consolidated
from nbshard.rank.host_memory import release_at_unit_boundaries, release_freed_memory
from nbshard.rank.lora import merge_lora

__all__ = ["build_sharded", "default_blocks", "full_state_dict", "merge_lora", "save_full", "save_sharded"]


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build modules with parameters on ``meta`` (no memory, no RNG) and buffers for real."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        with torch.random.fork_rng(devices=[]):  # whatever the constructors draw is not counted
            yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def default_blocks(model: nn.Module) -> list[nn.Module | list[nn.Module]]:
    """The units sharded one by one before the root: the children of the model's
    ``nn.ModuleList``s (a transformer's layers), and each large module outside them (an
    embedding, the output head: at least half a layer's parameters of its own) as a unit of its
    own, so the root does not hold them whole through forward and backward. Modules that share
    a parameter (a tied embedding and head) form one unit."""
    layers = [block for module in model.modules() if isinstance(module, nn.ModuleList) for block in module]
    if not layers:
        return []
    inside = {id(sub) for layer in layers for sub in layer.modules()}
    threshold = max(min(_parameter_count(layer) for layer in layers) // 2, 1)
    groups: list[tuple[set[int], list[nn.Module]]] = []
    for module in model.modules():
        own = {id(p): p.numel() for p in module.parameters(recurse=False)}
        if module is model or id(module) in inside or sum(own.values()) < threshold:
            continue
        group = next((g for g in groups if g[0] & own.keys()), None)
        if group is None:
            groups.append((set(own), [module]))
        else:
            group[0].update(own)
            group[1].append(module)
    return [*layers, *(modules[0] if len(modules) == 1 else modules for _, modules in groups)]


def _parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _parameter_bytes(modules: list[nn.Module]) -> int:
    unique = {id(p): p for module in modules for p in module.parameters()}
    return sum(p.numel() * p.element_size() for p in unique.values())


def build_sharded(
    build: Callable[[], nn.Module],
    *,
    full_checkpoint: str | os.PathLike[str] | None = None,
    sharded_checkpoint: str | os.PathLike[str] | None = None,
    strict: bool = True,
    seed: int = 0,
    blocks: Callable[[nn.Module], Iterable[nn.Module | list[nn.Module]]] = default_blocks,
    gather_in_chunks: bool = True,
    device: torch.device | str | None = None,
    return_freed_memory: bool | None = None,
    **shard_options: Any,
) -> nn.Module:
    """``build()`` sharded with FSDP2 across the process group, only the local shard in memory.

    ``full_checkpoint``: a ``torch.save`` file, a ``.safetensors`` file, a sharded
    one's ``*.index.json`` or a Hugging Face model directory, read by rank 0 alone
    through the model's own ``load_state_dict`` hooks (key renames); a
    ``torch.distributed.checkpoint`` directory is read as ``sharded_checkpoint``.
    A tied parameter is filled from whichever of its names the checkpoint has.
    ``strict=False`` leaves checkpoint keys the model lacks aside and initializes
    parameters the checkpoint lacks (e.g. new LoRA weights) as from scratch.
    ``blocks(model)`` names the units sharded one by one before the root, each a module
    or a list of modules sharded together (default: ``default_blocks``, the layers of
    each ``nn.ModuleList`` and large embeddings and heads). With ``gather_in_chunks``
    a unit made only of plain ``nn.Embedding``/``nn.Linear`` layers (a vocabulary's
    embedding and head) is not gathered whole around its use but a chunk of rows at a
    time, each chunk half the size of the largest other unit (``nbshard.chunked``).
    ``shard_options`` go to ``fully_shard`` (``mesh``, ``mp_policy``, ...). ``device``
    defaults to this rank's GPU, or the CPU. ``return_freed_memory`` (default: on for a
    model on the CPU) trims glibc's heap at each unit's boundaries in forward and backward
    (``nbshard.host_memory``), so a step's peak is what the step holds, not what glibc kept.
    """
    if full_checkpoint is not None and sharded_checkpoint is not None:
        raise ValueError("pass full_checkpoint= or sharded_checkpoint=, not both")
    if full_checkpoint is not None and (Path(full_checkpoint) / ".metadata").is_file():
        full_checkpoint, sharded_checkpoint = None, full_checkpoint  # a torch.distributed.checkpoint directory
    if not dist.is_initialized():
        raise RuntimeError("build_sharded needs a process group: call nbshard.init_process_group() first")
    device = torch.device(device) if device is not None else rank_device()
    with _parameters_on_meta():
        model = build()
    template = copy.deepcopy(model)  # unsharded, on meta: for matching keys and initializing
    units = [unit if isinstance(unit, list) else [unit] for unit in blocks(model)]
    mesh = shard_options.get("mesh")
    if mesh is None:  # what fully_shard would make: one dimension over every rank
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    shard_options = {**shard_options, "mesh": mesh}  # one mesh for every sharded parameter
    chunked = [unit for unit in units if gather_in_chunks and mesh.ndim == 1 and all(map(can_chunk, unit))]
    whole = [unit for unit in units if unit not in chunked]
    ignored = set(shard_options.pop("ignored_params", None) or ())
    if chunked:
        largest = max((_parameter_bytes(unit) for unit in whole), default=64 * 2**20)
        mp_policy = shard_options.get("mp_policy")
        ignored |= shard_by_rows([module for unit in chunked for module in unit], mesh, largest // 2,
                                 mp_policy.param_dtype if mp_policy is not None else None)
    for unit in whole:
        fully_shard(unit if len(unit) > 1 else unit[0], ignored_params=ignored or None, **shard_options)
    fully_shard(model, ignored_params=ignored or None, **shard_options)
    model.register_forward_hook(_reshard_unless_training)
    if return_freed_memory if return_freed_memory is not None else device.type == "cpu":
        release_at_unit_boundaries([model, *(module for unit in units for module in unit)])
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)  # allocates this rank's shard of each parameter only
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    if sharded_checkpoint is not None:
        _load_sharded(model, os.fspath(sharded_checkpoint))
    elif full_checkpoint is not None:
        missing = _load_full_from_rank0(model, template, os.fspath(full_checkpoint), strict)
        if missing:
            _init_from_rank0(model, template, seed, only=missing, units=units)
    else:
        _init_from_rank0(model, template, seed, units=units)
    return model


def _reshard_unless_training(model: nn.Module, args: Any, output: Any) -> None:
    """After a forward without gradients (checking a loaded model, evaluating), shard the root's
    own parameters again. FSDP2 keeps a root unsharded after forward for the backward to come;
    after a no-grad forward none comes, so the root would stay unsharded, and an optimizer made
    then, or ``requires_grad_`` set then (LoRA's ``mark_only_lora_as_trainable``), would hold
    the unsharded copies: the root's own parameters (a final norm) would never train."""
    if not torch.is_grad_enabled():
        model.reshard()


def _mismatch(expected: dict[str, torch.Size], found: dict[str, torch.Size], what: str) -> str | None:
    """A message naming missing, unexpected and reshaped keys; None when they agree."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    reshaped = {k: (found[k], expected[k]) for k in sorted(set(expected) & set(found)) if tuple(expected[k]) != tuple(found[k])}
    return _describe_mismatch(what, missing, unexpected, reshaped)


def _describe_mismatch(
    what: str, missing: list[str], unexpected: list[str], reshaped: dict[str, tuple[torch.Size, torch.Size]], hint: str = ""
) -> str | None:
    if not (missing or unexpected or reshaped):
        return None
    parts = [f"{what} does not match the model."]
    if missing:
        parts.append(f"Missing from it: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}.")
    if unexpected:
        parts.append(f"Not in the model: {', '.join(unexpected[:10])}{' ...' if len(unexpected) > 10 else ''}.")
    for key, (found, expected) in list(reshaped.items())[:10]:
        parts.append(f"{key}: the checkpoint has shape {tuple(found)}, the model {tuple(expected)}.")
    parts.append(hint or "Check that build() makes the model the checkpoint was saved from.")
    return " ".join(parts)


def _model_shapes(model: nn.Module) -> dict[str, torch.Size]:
    return {k: v.shape for k, v in get_model_state_dict(model).items()}  # DTensor shapes are global


def _load_sharded(model: nn.Module, path: str) -> None:
    reader = MappedReader(path)
    metadata = reader.read_metadata().state_dict_metadata
    found = {k: getattr(v, "size", torch.Size()) for k, v in metadata.items()}
    problem = _mismatch(_model_shapes(model), found, f"The sharded checkpoint {path}")
    if problem:
        raise ValueError(problem)
    state = get_model_state_dict(model)
    dcp.load(state, storage_reader=reader)  # each rank reads the pieces of its own shards
    set_model_state_dict(model, state)


def _plan_full_load(model: nn.Module, template: nn.Module, checkpoint: Checkpoint, strict: bool) -> dict[str, Any]:
    """On rank 0: which checkpoint key fills each of the model's tensors (tied ones once), which it
    lacks, and a message when they do not fit."""
    stored = {key: checkpoint.shape_and_dtype(key) for key in checkpoint.keys()}
    arrived, renamed = _match_with_prefixes(template, stored)
    shapes = {renamed[key]: shape for key, shape in stored.items()}
    fills: list[tuple[str, str]] = []
    missing: list[str] = []
    reshaped: dict[str, tuple[torch.Size, torch.Size]] = {}
    tensors = dict(model_keys(model))
    groups = _tensor_groups(model)
    for names in groups.values():
        found = next((name for name in names if name in arrived), None)
        if found is None:
            missing.append(names[0])
            continue
        expected, got = tensors[found].shape, shapes[arrived[found]][0]
        if tuple(expected) != tuple(got):
            reshaped[arrived[found]] = (got, expected)
        fills.append((found, arrived[found]))
    used = set(arrived.values())
    unexpected = [key for key in shapes if key not in used]
    # Keys the model says to leave aside, as from_pretrained does (GPT-2's old attn.bias masks).
    unexpected = [key for key in unexpected if not _ignored(template, "_keys_to_ignore_on_load_unexpected", key)]
    missing = [key for key in missing if not _ignored(template, "_keys_to_ignore_on_load_missing", key)]
    original = {new: old for old, new in renamed.items()}
    hint = "Check that build() makes the model the checkpoint was saved from" + (
        "; strict=False initializes what the checkpoint lacks (new LoRA weights) and leaves aside what the model lacks."
        if strict else "."
    )
    problem = _describe_mismatch(f"The checkpoint {checkpoint.path}", missing if strict else [], unexpected if strict else [], reshaped, hint)
    if problem is None and not strict and 2 * len(fills) < len(groups):
        problem = (
            f"build_sharded(strict=False): the checkpoint {checkpoint.path} fills only {len(fills)} of the model's "
            f"{len(groups)} tensors, so the model would be mostly random. Likely cause: it is another model's "
            f"checkpoint, or its keys are named differently (the checkpoint has {', '.join(list(stored)[:3])}; "
            f"the model expects {', '.join(next(iter(g)) for g in list(groups.values())[:3])}). Check that build() makes "
            "the model the checkpoint was saved from; strict=False is for a few tensors, such as new LoRA weights."
        )
    return {"fills": [(name, original[key]) for name, key in fills], "missing": missing,
            "unexpected": [original[key] for key in unexpected], "problem": problem}


def _ignored(model: nn.Module, patterns: str, key: str) -> bool:
    return any(re.search(pattern, key) for pattern in getattr(model, patterns, None) or ())


_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP's and torch.compile's wrappers, in saved keys


def _match_with_prefixes(template: nn.Module, stored: dict[str, tuple[torch.Size, torch.dtype]]) -> tuple[dict[str, str], dict[str, str]]:
    """``match_keys`` with the checkpoint's keys as they are, or with the model's base prefix added
    or removed (as Hugging Face's ``from_pretrained`` does: GPT-2 ships without ``transformer.``),
    or a wrapper's prefix removed; whichever fills most. Returns (model key -> renamed key,
    stored key -> renamed key)."""
    prefix = getattr(template, "base_model_prefix", "")
    renamings: list[Callable[[str], str]] = [lambda key: key]
    if isinstance(prefix, str) and prefix:
        renamings += [lambda key: key if key.startswith(f"{prefix}.") else f"{prefix}.{key}",
                      lambda key: key.removeprefix(f"{prefix}.")]
    renamings += [lambda key, wrapper=wrapper: key.removeprefix(wrapper) for wrapper in _WRAPPER_PREFIXES]
    best: tuple[dict[str, str], dict[str, str]] = ({}, {key: key for key in stored})
    for rename in renamings:
        renamed = {key: rename(key) for key in stored}
        if len(set(renamed.values())) < len(renamed):  # two stored keys under one name: not this renaming
            continue
        arrived = match_keys(template, {renamed[key]: shape for key, shape in stored.items()})
        if len(arrived) > len(best[0]):
            best = (arrived, renamed)
        if len(arrived) == len(stored):
            break
    return best


def _tensor_groups(model: nn.Module) -> dict[int, list[str]]:
    """The model's state-dict keys grouped by tensor: a tied parameter's names together."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model_keys(model):
        groups.setdefault(id(tensor), []).append(name)
    return groups


def _load_full_from_rank0(model: nn.Module, template: nn.Module, path: str, strict: bool) -> set[str]:
    """Fill each shard from the checkpoint that rank 0 alone reads, one tensor at a time; returns
    the keys of tensors it lacks (only with ``strict=False``)."""
    plan: list[dict[str, Any] | None] = [None]
    checkpoint = None  # rank 0's, opened once: for the plan, then the tensors
    if dist.get_rank() == 0:
        try:
            checkpoint = open_checkpoint(path)
            plan[0] = _plan_full_load(model, template, checkpoint, strict)
        except (OSError, ValueError, RuntimeError, ImportError) as error:
            plan[0] = {"problem": f"{type(error).__name__}: {error}"}
    dist.broadcast_object_list(plan, src=0)  # every rank raises together, none waits forever
    assert plan[0] is not None
    if plan[0]["problem"]:
        raise ValueError(plan[0]["problem"])
    if plan[0]["unexpected"] and dist.get_rank() == 0:
        left = plan[0]["unexpected"]
        warnings.warn(f"build_sharded(strict=False): {len(left)} checkpoint keys the model lacks were left aside: "
                      f"{', '.join(left[:10])}{' ...' if len(left) > 10 else ''}", stacklevel=3)
    tensors = dict(model_keys(model))
    with torch.no_grad():
        for name, key in plan[0]["fills"]:
            # Converted to the model's dtype a piece at a time; other ranks only receive.
            _scatter_into(tensors[name], checkpoint.tensor(key) if checkpoint is not None else None)
    return set(plan[0]["missing"])


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


def _init_groups(template: nn.Module, units: list[list[nn.Module]], whole_units: bool) -> list[list[nn.Module]]:
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
        index = unit_of.get(id(module))
        if index is None:
            groups.append([module])
        elif index in started:
            started[index].append(module)
        else:
            started[index] = [module]
            groups.append(started[index])
    return groups


def _init_from_rank0(
    model: nn.Module, template: nn.Module, seed: int, only: set[str] | None = None, units: list[list[nn.Module]] = ()
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
                    _scatter_into(target, module._parameters[name].detach() if rank == 0 else None)
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
            param = module._parameters[name]
            if param.is_floating_point():
                param.fill_(float("nan"))  # what no initializer writes stays NaN, and is named
            materialized.append((key, param))
    for module in group:
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    if init_weights is not None:
        for module in reversed(group):  # a module comes after its parent in registration order
            init_weights(module)
    # A sum is NaN when any element is; it allocates no tensor of the parameter's size.
    return [key for key, param in materialized if param.is_floating_point() and param.sum().isnan()]


def _same_modules_in(template: nn.Module, model: nn.Module, units: list[list[nn.Module]]) -> list[list[nn.Module]]:
    """``units`` (modules of ``model``) as the modules of ``template``, its copy, at the same names."""
    name_of = {id(module): name for name, module in model.named_modules()}
    in_template = dict(template.named_modules())
    return [[in_template[name_of[id(module)]] for module in unit] for unit in units]


_PIECE_BYTES = 64 * 2**20  # what rank 0 sends at a time while filling a row-sharded parameter


def _scatter_into(target: torch.Tensor, full: torch.Tensor | None) -> None:
    """Fill ``target`` (a sharded DTensor parameter) from rank 0's ``full`` tensor (None on the
    other ranks). A row-sharded one (FSDP2's layout) gets its rows straight into
    its shard a piece at a time, so rank 0 holds no copy of ``full`` beside it (``full`` may be a
    memory-mapped checkpoint tensor, of another dtype)."""
    if not isinstance(target, DTensor):
        if full is not None:
            target.copy_(full)
        dist.broadcast(target.data, src=0)
        return
    mesh, local = target.device_mesh, target.to_local()
    if mesh.ndim != 1 or tuple(target.placements) != (Shard(0),) or not local.is_contiguous() or target.ndim == 0:
        whole = (full if full is not None else torch.empty(target.shape, dtype=local.dtype)).to(local.device, local.dtype)
        local.copy_(distribute_tensor(whole, mesh, target.placements, src_data_rank=0).to_local())
        return
    group, me = mesh.get_group(), mesh.get_local_rank()
    piece_rows = max(1, _PIECE_BYTES // max(math.prod(target.shape[1:]) * local.element_size(), 1))
    for owner in range(mesh.size()):
        span = row_span(target.shape[0], mesh.size(), owner)
        for start in range(span.start, span.stop, piece_rows):
            stop = min(start + piece_rows, span.stop)
            if full is not None:
                piece = full[start:stop].to(local.device, local.dtype)
                if owner == 0:
                    local[start:stop].copy_(piece)
                else:
                    dist.send(piece.contiguous(), group_dst=owner, group=group)
            elif me == owner:
                dist.recv(local[start - span.start:stop - span.start], group_src=0, group=group)


def full_state_dict(
    model: nn.Module, *, trainable_only: bool = False, keys_of: nn.Module | None = None
) -> dict[str, torch.Tensor] | None:
    """The model's state dict, gathered into rank 0's CPU memory; None on other ranks.

    Collective: every rank must call it. Tensors are gathered one at a time and
    only rank 0 keeps them, so no rank holds a full copy on its device.
    ``trainable_only``: only parameters that require grad (e.g. the LoRA weights).
    ``keys_of``: another model (e.g. the plain base model, built on ``meta``) whose
    keys to use: each tensor under the key that model's checkpoint would have, as
    this model's own load hooks map them (LoRA's ``head.linear.weight`` is the
    base's ``head.weight``); tensors it has no key for are left out. That is not a
    merge: fold LoRA weights into the base first (``merge_lora(model)`` in the ranks for
    litgpt's layers, PEFT's ``merge_and_unload`` in one process) when the base should carry them.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    state = get_model_state_dict(model, options=options)
    if dist.get_rank() != 0:
        return None
    if keys_of is not None:
        theirs = match_keys(model, {key: (value.shape, value.dtype) for key, value in keys_of.state_dict().items()})
        state = {theirs[key]: value for key, value in state.items() if key in theirs}
    return state


def save_full(
    model: nn.Module, path: str | os.PathLike[str], *, trainable_only: bool = False, keys_of: nn.Module | None = None
) -> None:
    """Write one plain state dict from rank 0 (``torch.save``'s format, or safetensors for a path
    ending in ``.safetensors``) that ``load_state_dict`` reads; options as ``full_state_dict``.
    Collective. Written a tensor at a time as each is gathered (``nbshard.full_checkpoint``), so
    rank 0 holds its shard and one tensor, not the whole model."""
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    state = get_model_state_dict(model, options=options)  # this rank's shards: nothing gathered yet
    which = {name: names[0] for names in _tensor_groups(model).values() for name in names}  # tied keys: one tensor
    entries = [(key, value, which.get(key, key)) for key, value in state.items()]
    if keys_of is not None:
        theirs = match_keys(model, {key: (value.shape, value.dtype) for key, value in keys_of.state_dict().items()})
        entries = [(theirs[key], value, tensor) for key, value, tensor in entries if key in theirs]
    del state
    write_consolidated(entries, path)
    del entries
    if any(p.device.type == "cpu" for p in model.parameters()):
        release_freed_memory()  # what glibc kept of the gathered tensors goes back to the system
    dist.barrier()


def save_sharded(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Write a sharded ``torch.distributed.checkpoint`` directory: each rank its own shards. Collective."""
    dcp.save(get_model_state_dict(model), checkpoint_id=os.fspath(path))
