"""Fold LoRA weights into their base weights inside the ranks, on a sharded model.

For code inside the ranks (it imports torch). litgpt's ``merge_lora_weights`` computes
``B @ A`` on the layers' own parameters, which on a model sharded with FSDP2 are
DTensors: the grouped ``conv1d`` of its fused QKV layer has no DTensor rule, and the
merge fails. Here each layer's small ``A`` and ``B`` are gathered whole, the layer's own
``get_lora_AB()`` computes its update from them, and each rank adds its rows of the
update to its shard of the base weight: no rank holds more than one layer's update.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from nbshard.rank.chunked import row_span

__all__ = ["merge_lora"]


def _lora_layers(model: nn.Module) -> list[Any]:  # litgpt's LoRA layers: their attributes are theirs
    """litgpt's LoRA layers (``LoRALinear``, ``LoRAQKVLinear``): a base ``linear``, ``lora_A``,
    ``lora_B``, ``get_lora_AB()`` and a ``merged`` flag."""
    return [
        module for module in model.modules()
        if callable(getattr(module, "get_lora_AB", None)) and hasattr(module, "merged") and hasattr(module, "linear")
    ]


def merge_lora(model: nn.Module) -> int:
    """Merge every LoRA layer of ``model`` (sharded or not) into its base weight, as litgpt's
    ``merge_lora_weights`` does in one process; returns how many layers it merged. Collective:
    every rank calls it. PEFT's layers are not of this kind: gather them with
    ``full_state_dict()`` and use ``merge_and_unload()`` in one process."""
    layers = _lora_layers(model)
    if not layers:
        raise ValueError(
            "merge_lora: the model has no LoRA layers of litgpt's kind (with get_lora_AB() and merged). "
            "For PEFT's, gather the model with fsdp.full_state_dict() and merge with merge_and_unload() in one process."
        )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # the parameters to change are the shards, not a gathered copy
    merged = 0
    with torch.no_grad():
        for layer in layers:
            if layer.merged or getattr(layer, "r", 1) == 0 or not any(getattr(layer, "enable_lora", (True,))):
                continue
            _add_update(layer.linear.weight, _whole_update(layer))
            layer.merged = True
            merged += 1
    return merged


def _whole_update(layer: Any) -> torch.Tensor:
    """``B @ A * scaling`` as the layer computes it, from its A and B gathered whole."""
    sharded: dict[str, Any] = {name: layer._parameters[name] for name in ("lora_A", "lora_B")}
    try:
        for name, param in sharded.items():
            whole = param.full_tensor() if isinstance(param, DTensor) else param
            layer._parameters[name] = nn.Parameter(whole.detach(), requires_grad=False)
        return layer.get_lora_AB()
    finally:
        layer._parameters.update(sharded)


def _add_update(weight: torch.Tensor, update: torch.Tensor) -> None:
    if not isinstance(weight, DTensor):
        weight.add_(update.to(weight.device, weight.dtype))
        return
    local, mesh = weight.to_local(), weight.device_mesh
    if mesh.ndim == 1 and tuple(weight.placements) == (Shard(0),):
        rows = row_span(weight.shape[0], mesh.size(), mesh.get_local_rank())
        local.add_(update[rows.start:rows.stop].to(local.device, local.dtype))
    else:
        local.add_(distribute_tensor(update.to(local.device, local.dtype), mesh, weight.placements).to_local())
