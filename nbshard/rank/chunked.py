"""Embeddings and output heads too large to gather whole: sharded by rows, gathered a chunk at a time.

FSDP2 gathers a unit's parameters whole around its use. For a language model's
embedding and head (a 128,256-token vocabulary is a fifth of a 1B model, and
most of a small one) that is the largest thing any rank ever holds beside its
shard: the gathered weight, and in backward its unsharded gradient too. Here
such a weight stays a ``DTensor`` sharded by rows (``Shard(0)``, FSDP2's own
layout, so state dicts, checkpoints, optimizers and gradient clipping treat it
like any sharded parameter) and its module computes in chunks: each step
gathers a few rows from every rank, uses them and lets them go; in backward the
chunk's gradient is reduce-scattered to the rows' owners, averaged over the
ranks and added to the parameter's ``.grad``, as FSDP2 does. Every rank keeps
its own batch (data parallel), of any shape. As FSDP2 prefetches the next unit, the next
chunk's gather runs while this one computes, and a chunk's reduce-scatter while the next
chunk's gradient is computed (two chunks held at a time). Only plain ``nn.Linear`` and
``nn.Embedding`` (without ``max_norm``, ``sparse`` or ``scale_grad_by_freq``)
are taken.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

__all__ = ["can_chunk", "row_span", "shard_by_rows"]


def can_chunk(module: nn.Module) -> bool:
    """Whether ``module`` is a layer this module knows how to compute a chunk at a time."""
    if type(module) is nn.Linear:
        return True
    return type(module) is nn.Embedding and module.max_norm is None and not module.sparse and not module.scale_grad_by_freq


def row_span(rows: int, world: int, rank: int) -> range:
    """The rows ``rank`` holds of ``rows`` split over ``world`` ranks as ``torch.chunk`` (and
    DTensor's ``Shard(0)``, FSDP2's layout) splits them."""
    per_rank = math.ceil(rows / world)
    return range(min(rank * per_rank, rows), min((rank + 1) * per_rank, rows))


class _Rows:
    """How a weight of ``rows`` rows is split: rank r holds rows [r*per_rank, ...) as
    ``torch.chunk`` (and DTensor's ``Shard(0)``) splits them, padded to ``per_rank`` to gather."""

    def __init__(self, rows: int, mesh: DeviceMesh, chunk_rows: int) -> None:
        self.rows, self.group = rows, mesh.get_group()
        self.world = mesh.size()
        self.per_rank = math.ceil(rows / self.world)
        self.chunk = max(1, min(chunk_rows, self.per_rank))
        self.local_rows = len(row_span(rows, self.world, mesh.get_local_rank()))

    def chunks(self) -> range:
        return range(0, self.per_rank, self.chunk)

    def gathers(self, local: torch.Tensor, dtype: torch.dtype) -> Iterator[tuple[int, torch.Tensor]]:
        """Each chunk's start and its rows of every rank's shard, (world, chunk, ...) (zeros past a
        shard's end), the next chunk's gather running while the caller computes with this one
        (as FSDP2 prefetches the next unit): two chunks are held at a time."""
        starts = list(self.chunks())
        pending = self._start_gather(local, starts[0])
        for index, start in enumerate(starts):
            work, gathered = pending
            work.wait()
            if index + 1 < len(starts):
                pending = self._start_gather(local, starts[index + 1])
            yield start, gathered.view(self.world, self.chunk, *local.shape[1:]).to(dtype)

    def _start_gather(self, local: torch.Tensor, start: int) -> tuple[Any, torch.Tensor]:
        piece = local[start:start + self.chunk]
        if len(piece) < self.chunk:  # past the shard's end: zeros, as every rank sends as many rows
            piece = torch.cat([piece, piece.new_zeros((self.chunk - len(piece), *local.shape[1:]))])
        gathered = torch.empty((self.world * self.chunk, *local.shape[1:]), dtype=local.dtype, device=local.device)
        return dist.all_gather_single(gathered, piece.contiguous(), group=self.group, async_op=True), gathered

    def reduce(self, grad: torch.Tensor, local_grad: torch.Tensor, start: int) -> Callable[[], None]:
        """Start summing ``grad`` (world, chunk, ...) over the ranks into the owners' rows, averaged
        as FSDP2 does; the returned function waits for it and adds it (the caller computes the next
        chunk's gradient meanwhile)."""
        grad = grad.to(local_grad.dtype).reshape(self.world * self.chunk, *grad.shape[2:]).contiguous()
        mine = torch.empty((self.chunk, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        work = dist.reduce_scatter_single(mine, grad, group=self.group, async_op=True)

        def add() -> None:
            work.wait()
            rows = local_grad[start:start + self.chunk]
            rows += mine[: len(rows)].div_(self.world)

        return add

    def padded(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s last dimension (one entry per row) padded to world * per_rank, viewed (..., world, per_rank)."""
        width = self.world * self.per_rank
        if tensor.shape[-1] != width:
            tensor = nn.functional.pad(tensor, (0, width - tensor.shape[-1]))
        return tensor.reshape(*tensor.shape[:-1], self.world, self.per_rank)


class _ChunkedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: _Rows,
                module: nn.Module) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.rows, ctx.module = rows, module
        out = x.new_empty(*x.shape[:-1], rows.world * rows.per_rank)
        grid = out.view(*x.shape[:-1], rows.world, rows.per_rank)  # column r * per_rank + j: rank r's row j
        for start, piece in rows.gathers(weight, x.dtype):  # piece: (world, chunk, in)
            width = min(rows.chunk, rows.per_rank - start)
            part = (x @ piece.flatten(0, 1).T).unflatten(-1, (rows.world, rows.chunk))
            grid[..., start:start + width] = part[..., :width]
            del piece, part
        if out.shape[-1] != rows.rows:  # the last shard's padding
            out = out[..., : rows.rows].contiguous()
        if bias is not None:
            out = out + _gathered_whole(bias, rows).to(out.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        rows: _Rows = ctx.rows
        grad_padded = rows.padded(grad_out)
        grad_x = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        grad_weight = _grad_of(ctx.module.weight) if ctx.needs_input_grad[1] else None
        flat_x = x.reshape(-1, x.shape[-1])
        pieces = rows.gathers(weight, x.dtype) if grad_x is not None else ((start, None) for start in rows.chunks())
        reducing = _Reductions()
        for start, piece in pieces:
            g = torch.zeros((*grad_out.shape[:-1], rows.world, rows.chunk), dtype=grad_out.dtype, device=grad_out.device)
            width = min(rows.chunk, rows.per_rank - start)
            g[..., :width] = grad_padded[..., start:start + width]
            g = g.flatten(-2)
            if grad_x is not None and piece is not None:
                grad_x += g @ piece.flatten(0, 1)
            if grad_weight is not None:
                piece_grad = g.reshape(-1, g.shape[-1]).T @ flat_x  # (world * chunk, in)
                reducing.next(rows.reduce(piece_grad.view(rows.world, rows.chunk, -1), grad_weight, start))
        if ctx.needs_input_grad[2]:
            whole = rows.padded(grad_out.reshape(-1, grad_out.shape[-1]).sum(0))  # (world, per_rank)
            grad_bias = _grad_of(ctx.module.bias)
            for start in rows.chunks():
                grad = whole[:, start:start + rows.chunk]
                grad = nn.functional.pad(grad, (0, rows.chunk - grad.shape[-1]))
                reducing.next(rows.reduce(grad, grad_bias, start))
        reducing.finish()
        return grad_x, None, None, None, None  # the parameters' gradients are in their .grad


class _ChunkedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, rows: _Rows, module: nn.Module,
                dtype: torch.dtype) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows.rows):
            raise IndexError(f"index out of range in self: token ids must lie in [0, {rows.rows}), "
                             f"these lie in [{int(ids.min())}, {int(ids.max())}]")
        owner, row = ids // rows.per_rank, ids % rows.per_rank
        ctx.save_for_backward(owner, row)
        ctx.rows, ctx.module = rows, module
        out = torch.empty((*ids.shape, weight.shape[1]), dtype=dtype, device=weight.device)
        for start, piece in rows.gathers(weight, dtype):
            here = (row >= start) & (row < start + rows.chunk)
            out[here] = piece[owner[here], row[here] - start]
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        owner, row = ctx.saved_tensors
        rows: _Rows = ctx.rows
        padding_idx = ctx.module.padding_idx
        if padding_idx is not None:  # as nn.Embedding: the padding row gets no gradient
            grad_out = grad_out.masked_fill((owner * rows.per_rank + row == padding_idx).unsqueeze(-1), 0)
        grad_weight = _grad_of(ctx.module.weight)
        reducing = _Reductions()
        for start in rows.chunks():
            here = (row >= start) & (row < start + rows.chunk)
            piece = torch.zeros((rows.world, rows.chunk, grad_out.shape[-1]), dtype=grad_out.dtype, device=grad_out.device)
            piece.index_put_((owner[here], row[here] - start), grad_out[here], accumulate=True)
            reducing.next(rows.reduce(piece, grad_weight, start))
        reducing.finish()
        return None, None, None, None, None  # the weight's gradient is in its .grad


class _Reductions:
    """A chunk's gradient reduce-scatter runs while the next chunk's is computed: one at a time
    in flight, each waited for (and added) before the next starts."""

    def __init__(self) -> None:
        self._pending: Callable[[], None] | None = None

    def next(self, add: Callable[[], None]) -> None:
        self.finish()
        self._pending = add

    def finish(self) -> None:
        if self._pending is not None:
            self._pending()
            self._pending = None


def _grad_of(param: nn.Parameter) -> torch.Tensor:
    """The local shard of ``param.grad``, made zeros if there is none. As FSDP2 does, the reduced
    gradient is added there directly: autograd would make a temporary of the shard's size and add it."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    grad: Any = param.grad  # a DTensor, as the parameter
    return grad.to_local()


def _gathered_whole(local: torch.Tensor, rows: _Rows) -> torch.Tensor:
    """A small row-sharded tensor (a bias) gathered whole: (rows,)."""
    chunks = torch.cat([piece for _, piece in rows.gathers(local, local.dtype)], dim=1)
    return chunks[:, : rows.per_rank].flatten()[: rows.rows]


class _ChunkedModule(nn.Module):
    """Mixed into an ``nn.Linear`` or ``nn.Embedding`` whose weight (and bias) are row-sharded DTensors."""

    _nbshard_rows: _Rows
    _nbshard_dtype: torch.dtype | None

    weight: Any  # DTensors, row-sharded
    bias: Any

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (torch's name)
        weight = self.weight.to_local()
        if isinstance(self, nn.Embedding):
            dtype = self._nbshard_dtype or weight.dtype
            return _ChunkedEmbedding.apply(input, weight, self._nbshard_rows, self, dtype)
        bias = self.bias.to_local() if self.bias is not None else None
        if input.is_floating_point() and self._nbshard_dtype is not None:
            input = input.to(self._nbshard_dtype)
        return _ChunkedLinear.apply(input, weight, bias, self._nbshard_rows, self)


_CLASSES: dict[type, type] = {}


def _chunked_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Chunked{base.__name__}", (_ChunkedModule, base), {})
    return _CLASSES[base]


def shard_by_rows(modules: list[nn.Module], mesh: DeviceMesh, chunk_bytes: int,
                  compute_dtype: torch.dtype | None = None) -> set[nn.Parameter]:
    """Make each module's parameters row-sharded DTensors (still on ``meta``: they are
    allocated and filled with the rest of the model) and compute it a chunk of about
    ``chunk_bytes`` at a time. Tied parameters stay tied. Returns the parameters, which
    FSDP2 must leave alone."""
    converted: dict[int, nn.Parameter] = {}
    module: Any  # an nn.Linear or nn.Embedding: its weight is a tensor
    for module in modules:
        if not can_chunk(module):
            raise ValueError(f"only plain nn.Linear and nn.Embedding layers can be computed in chunks, not {module!r}")
        row_bytes = module.weight[0].numel() * module.weight.element_size() * mesh.size()
        rows = _Rows(module.weight.shape[0], mesh, max(1, chunk_bytes // max(row_bytes, 1)))
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in converted:
                sharded = DTensor.from_local(
                    torch.empty((rows.local_rows, *param.shape[1:]), dtype=param.dtype, device="meta"),
                    mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride())
                converted[id(param)] = nn.Parameter(sharded, requires_grad=param.requires_grad)
            setattr(module, name, converted[id(param)])
        module.__class__ = _chunked_class(type(module))
        module._nbshard_rows, module._nbshard_dtype = rows, compute_dtype
    return set(converted.values())
