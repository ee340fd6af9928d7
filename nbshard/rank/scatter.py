"""Whole tensors between rank 0 and the shards, in FSDP2's layout, without a second copy.

For code inside the ranks (it imports torch). ``scatter_into`` fills a sharded parameter
from a tensor only rank 0 has (a checkpoint's, memory-mapped; an initialized module's);
``gather_to_rank0`` brings a sharded tensor whole to rank 0 alone. A row-sharded tensor
(``Shard(0)``, FSDP2's layout) goes rows straight into their place, a piece at a time;
other layouts through DTensor's own collectives.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from nbshard.rank.chunked import row_span

__all__ = ["gather_to_rank0", "scatter_into"]


_PIECE_BYTES = 64 * 2**20  # what rank 0 sends at a time while filling a row-sharded parameter


def scatter_into(target: torch.Tensor, full: torch.Tensor | None) -> None:
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


def gather_to_rank0(tensor: DTensor) -> torch.Tensor | None:
    """The whole tensor on rank 0's CPU (None elsewhere). Row-sharded (FSDP2's layout): each rank
    sends its rows straight into their place in it, so rank 0 holds it once; other layouts
    through ``full_tensor()``."""
    mesh, local = tensor.device_mesh, tensor.to_local()
    rows_sharded = mesh.ndim == 1 and tuple(tensor.placements) == (Shard(0),) and tensor.ndim > 0
    if not rows_sharded or mesh.size() != dist.get_world_size() or not local.is_contiguous():
        return tensor.full_tensor()
    group, me = mesh.get_group(), mesh.get_local_rank()
    if me != 0:
        if local.shape[0]:
            dist.send(local, group_dst=0, group=group)
        return None
    full = torch.empty(tensor.shape, dtype=local.dtype)
    for owner in range(mesh.size()):
        rows = row_span(tensor.shape[0], mesh.size(), owner)
        if not rows:
            continue
        if owner == 0:
            full[rows.start:rows.stop].copy_(local)
        elif local.device.type == "cpu":
            dist.recv(full[rows.start:rows.stop], group_src=owner, group=group)
        else:  # NCCL receives on the device: one owner's rows at a time, then to the CPU
            piece = torch.empty((len(rows), *tensor.shape[1:]), dtype=local.dtype, device=local.device)
            dist.recv(piece, group_src=owner, group=group)
            full[rows.start:rows.stop].copy_(piece)
    return full
