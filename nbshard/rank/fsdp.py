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
  at a time, sending each rank its rows (``nbshard.rank.full_load``);
- from scratch: rank 0 initializes one module at a time with each module's own
  ``reset_parameters()`` in the order the model registers its modules, under
  ``seed``, and scatters it (``nbshard.rank.initialize``). With torch.nn's layers
  this makes the gathered model bit-for-bit equal to ``torch.manual_seed(seed);
  build()`` in one process (tied weights too, when the tie is made after the layers
  are built), while no rank holds more than its shard and one module. A parameter
  whose module has no ``reset_parameters()`` is an error that names it.

A vocabulary's embedding and head are not gathered whole but a chunk of rows at
a time (``nbshard.rank.chunked``). ``save_full`` writes one file a tensor at a time
(``nbshard.rank.full_checkpoint``); ``merge_lora`` folds litgpt's LoRA layers into
their base weights in the ranks (``nbshard.rank.lora``).
"""

from __future__ import annotations

import contextlib
import copy
import os
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

from nbshard.rank.checkpoints import MappedReader, match_keys, tensor_groups
from nbshard.rank.chunked import can_chunk, shard_by_rows
from nbshard.rank.dist import device as rank_device
from nbshard.rank.full_checkpoint import write_consolidated
from nbshard.rank.full_load import load_full_from_rank0, mismatch
from nbshard.rank.host_memory import release_at_unit_boundaries, release_freed_memory
from nbshard.rank.initialize import init_from_rank0
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

    setattr(nn.Module, "register_parameter", register_on_meta)
    try:
        with torch.random.fork_rng(devices=[]):  # whatever the constructors draw is not counted
            yield
    finally:
        setattr(nn.Module, "register_parameter", register)


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
    embedding and head) and larger than every other unit (so that gathering it whole
    would raise the peak) is not gathered whole around its use but a chunk of rows at a
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
    chunkable = [unit for unit in units if gather_in_chunks and mesh.ndim == 1 and all(map(can_chunk, unit))]
    others = [_parameter_bytes(unit) for unit in units if unit not in chunkable]
    # In chunks only where gathering it whole would raise the peak: a unit larger than every other.
    chunked = [unit for unit in chunkable if _parameter_bytes(unit) > max(others, default=0)]
    whole = [unit for unit in units if unit not in chunked]
    ignored = set(shard_options.pop("ignored_params", None) or ())
    if chunked:
        largest = max(others, default=64 * 2**20)
        mp_policy = shard_options.get("mp_policy")
        ignored |= shard_by_rows([module for unit in chunked for module in unit], mesh, largest // 2,
                                 mp_policy.param_dtype if mp_policy is not None else None)
    for unit in whole:
        fully_shard(unit if len(unit) > 1 else unit[0], ignored_params=ignored or None, **shard_options)
    fully_shard(model, ignored_params=ignored or None, **shard_options)
    model.register_forward_hook(_reshard_unless_training)
    if return_freed_memory if return_freed_memory is not None else device.type == "cpu":
        boundaries = [model, *(module for unit in units for module in unit)]
        # In forward, only before the chunked units: before every layer it cost the step 5% and
        # lowered no peak (nbshard.rank.host_memory).
        release_at_unit_boundaries(boundaries, [m for m in boundaries if hasattr(m, "_nbshard_rows")] or None)
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)  # allocates this rank's shard of each parameter only
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    if sharded_checkpoint is not None:
        _load_sharded(model, os.fspath(sharded_checkpoint))
    elif full_checkpoint is not None:
        missing = load_full_from_rank0(model, template, os.fspath(full_checkpoint), strict)
        if missing:
            init_from_rank0(model, template, seed, only=missing, units=units)
    else:
        init_from_rank0(model, template, seed, units=units)
    return model


def _reshard_unless_training(model: Any, args: Any, output: Any) -> None:  # an FSDPModule
    """After a forward without gradients (checking a loaded model, evaluating), shard the root's
    own parameters again. FSDP2 keeps a root unsharded after forward for the backward to come;
    after a no-grad forward none comes, so the root would stay unsharded, and an optimizer made
    then, or ``requires_grad_`` set then (LoRA's ``mark_only_lora_as_trainable``), would hold
    the unsharded copies: the root's own parameters (a final norm) would never train."""
    if not torch.is_grad_enabled():
        model.reshard()


def _model_shapes(model: nn.Module) -> dict[str, torch.Size]:
    state: dict[str, Any] = get_model_state_dict(model)  # tensors
    return {k: v.shape for k, v in state.items()}  # DTensor shapes are global


def _load_sharded(model: nn.Module, path: str) -> None:
    reader = MappedReader(path)
    metadata = reader.read_metadata().state_dict_metadata
    found = {k: getattr(v, "size", torch.Size()) for k, v in metadata.items()}
    problem = mismatch(_model_shapes(model), found, f"The sharded checkpoint {path}")
    if problem:
        raise ValueError(problem)
    state = get_model_state_dict(model)
    dcp.load(state, storage_reader=reader)  # each rank reads the pieces of its own shards
    set_model_state_dict(model, state)


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
    state: dict[str, Any] = get_model_state_dict(model, options=options)  # tensors
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
    state: dict[str, Any] = get_model_state_dict(model, options=options)  # this rank's shards (tensors): nothing gathered yet
    which = {name: names[0] for names in tensor_groups(model).values() for name in names}  # tied keys: one tensor
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
