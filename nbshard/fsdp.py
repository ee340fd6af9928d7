"""Only the shard in memory: build a model with FSDP2 so no rank ever holds a full copy.

For code running inside the ranks (it imports torch; ``import nbshard`` does not import it)::

    from nbshard import fsdp

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
- from a full checkpoint that rank 0 alone reads, memory-mapped, and
  broadcasts (``set_model_state_dict(..., broadcast_from_rank0=True)``);
- from scratch: rank 0 initializes one module at a time with each module's own
  ``reset_parameters()`` in the order the model registers its modules, under
  ``seed``, and scatters it. With torch.nn's layers this makes the gathered
  model bit-for-bit equal to ``torch.manual_seed(seed); build()`` in one
  process (tied weights too, when the tie is made after the layers are built),
  while no rank holds more than its shard and one module. A parameter whose
  module has no ``reset_parameters()`` is an error that names it.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["build_sharded", "default_blocks", "full_state_dict", "save_full", "save_sharded"]


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


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of the model's ``nn.ModuleList``s: a transformer's layers."""
    return [block for module in model.modules() if isinstance(module, nn.ModuleList) for block in module]


def build_sharded(
    build: Callable[[], nn.Module],
    *,
    full_checkpoint: str | os.PathLike[str] | None = None,
    sharded_checkpoint: str | os.PathLike[str] | None = None,
    seed: int = 0,
    blocks: Callable[[nn.Module], Iterable[nn.Module]] = default_blocks,
    device: torch.device | str | None = None,
    **shard_options: Any,
) -> nn.Module:
    """``build()`` sharded with FSDP2 across the process group, only the local shard in memory.

    ``blocks(model)`` names the modules sharded one by one before the root
    (default: the layers of each ``nn.ModuleList``); ``shard_options`` go to
    ``fully_shard`` (``mesh``, ``mp_policy``, ...). ``device`` defaults to this
    rank's GPU, or the CPU.
    """
    if full_checkpoint is not None and sharded_checkpoint is not None:
        raise ValueError("pass full_checkpoint= or sharded_checkpoint=, not both")
    if not dist.is_initialized():
        raise RuntimeError("build_sharded needs a process group: call nbshard.init_process_group() first")
    device = torch.device(device) if device is not None else _rank_device()
    with _parameters_on_meta():
        model = build()
    template = copy.deepcopy(model) if full_checkpoint is None and sharded_checkpoint is None else None
    for block in blocks(model):
        fully_shard(block, **shard_options)
    fully_shard(model, **shard_options)
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)  # allocates this rank's shard of each parameter only
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    if sharded_checkpoint is not None:
        _load_sharded(model, os.fspath(sharded_checkpoint))
    elif full_checkpoint is not None:
        _load_full_from_rank0(model, os.fspath(full_checkpoint))
    else:
        _init_from_rank0(model, template, seed)  # type: ignore[arg-type]
    return model


def _rank_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _mismatch(expected: dict[str, torch.Size], found: dict[str, torch.Size], what: str) -> str | None:
    """A message naming missing, unexpected and reshaped keys; None when they agree."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    reshaped = sorted(k for k in set(expected) & set(found) if tuple(expected[k]) != tuple(found[k]))
    if not (missing or unexpected or reshaped):
        return None
    parts = [f"{what} does not match the model."]
    if missing:
        parts.append(f"Missing from it: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}.")
    if unexpected:
        parts.append(f"Not in the model: {', '.join(unexpected[:10])}{' ...' if len(unexpected) > 10 else ''}.")
    for key in reshaped[:10]:
        parts.append(f"{key}: the checkpoint has shape {tuple(found[key])}, the model {tuple(expected[key])}.")
    parts.append("Check that build() makes the model the checkpoint was saved from.")
    return " ".join(parts)


def _model_shapes(model: nn.Module) -> dict[str, torch.Size]:
    return {k: v.shape for k, v in get_model_state_dict(model).items()}  # DTensor shapes are global


def _load_sharded(model: nn.Module, path: str) -> None:
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    found = {k: getattr(v, "size", torch.Size()) for k, v in metadata.items()}
    problem = _mismatch(_model_shapes(model), found, f"The sharded checkpoint {path}")
    if problem:
        raise ValueError(problem)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path)  # each rank reads the pieces of its own shards
    set_model_state_dict(model, state)


def _load_full_from_rank0(model: nn.Module, path: str) -> None:
    problem: list[str | None] = [None]
    full: dict[str, torch.Tensor] = {}
    if dist.get_rank() == 0:
        full = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        problem[0] = _mismatch(_model_shapes(model), {k: v.shape for k, v in full.items()}, f"The checkpoint {path}")
    dist.broadcast_object_list(problem, src=0)  # every rank raises together, none waits forever
    if problem[0]:
        raise ValueError(problem[0])
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _init_from_rank0(model: nn.Module, template: nn.Module, seed: int) -> None:
    rank = dist.get_rank()
    targets = dict(model.named_parameters(remove_duplicate=False))
    done: set[int] = set()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for prefix, module in template.named_modules():
            own = dict(module.named_parameters(recurse=False))
            if not own or not hasattr(module, "reset_parameters"):
                continue
            if rank == 0:  # draws in the order construction would have
                module.to_empty(device="cpu", recurse=False)
                module.reset_parameters()
            for name, meta in own.items():
                target = targets[f"{prefix}.{name}" if prefix else name]
                if id(target) in done:  # a tied parameter keeps its first owner's values
                    continue
                full = module._parameters[name] if rank == 0 else torch.empty(meta.shape, dtype=meta.dtype)
                _scatter_into(target, full.detach())
                done.add(id(target))
            module.to_empty(device="meta", recurse=False)  # rank 0 lets go of the module
    left = sorted(name for name, param in targets.items() if id(param) not in done)
    if left:
        raise ValueError(
            f"no reset_parameters() initializes {', '.join(left[:10])}: their modules define none. "
            "Give those modules a reset_parameters(), or load a checkpoint (full_checkpoint=...)."
        )


def _scatter_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Fill ``target`` (a sharded DTensor parameter) from rank 0's ``full`` tensor."""
    if not isinstance(target, DTensor):
        dist.broadcast(full, src=0)
        target.copy_(full)
        return
    local = distribute_tensor(full.to(target.to_local().device), target.device_mesh, target.placements, src_data_rank=0)
    target.to_local().copy_(local.to_local())


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict, gathered into rank 0's CPU memory; None on other ranks.

    Collective: every rank must call it. Tensors are gathered one at a time and
    only rank 0 keeps them, so no rank holds a full copy on its device.
    """
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if dist.get_rank() == 0 else None


def save_full(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Write one plain state dict (``model.load_state_dict`` reads it) from rank 0. Collective."""
    state = full_state_dict(model)
    if state is not None:
        torch.save(state, path)
    dist.barrier()


def save_sharded(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Write a sharded ``torch.distributed.checkpoint`` directory: each rank its own shards. Collective."""
    dcp.save(get_model_state_dict(model), checkpoint_id=os.fspath(path))
