"""The checkpoints people have, read one tensor at a time, and matched to a model's own keys.

For code inside the ranks (it imports torch). ``open_checkpoint`` reads a
``torch.save`` file (memory-mapped; also one that wraps its state dict as
``{"model": ...}`` or ``{"state_dict": ...}``), a ``.safetensors`` file, a
sharded one with its ``*.index.json``, or a Hugging Face model directory;
``MappedReader`` reads a ``torch.distributed.checkpoint`` directory the same
way, through memory maps.
``match_keys`` asks the model itself which checkpoint key fills which of its
parameters, by running its own ``load_state_dict`` hooks (renames such as
litgpt's LoRA layers make) over placeholder tensors on ``meta``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.futures import Future
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

__all__ = ["Checkpoint", "MappedReader", "match_keys", "model_keys", "open_checkpoint", "tensor_groups"]


_WRAPPERS = ("state_dict", "model", "module")  # checkpoints that hold the state dict under one key
_HF_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin")


class Checkpoint:
    """A checkpoint's tensors by key: shapes and dtypes without reading them, then one at a time."""

    def __init__(self, path: Path, files: dict[str, Path]) -> None:
        self.path = path
        self._files = files  # key -> the file that holds it
        self._open: dict[Path, Any] = {}

    def keys(self) -> list[str]:
        return list(self._files)

    def _source(self, key: str) -> Any:
        file = self._files[key]
        if file not in self._open:
            self._open[file] = _open_file(file)
        return self._open[file]

    def shape_and_dtype(self, key: str) -> tuple[torch.Size, torch.dtype]:
        source = self._source(key)
        if isinstance(source, dict):
            return source[key].shape, source[key].dtype
        piece = source.get_slice(key)
        return torch.Size(piece.get_shape()), _SAFETENSORS_DTYPES[piece.get_dtype()]

    def tensor(self, key: str) -> torch.Tensor:
        source = self._source(key)
        return source[key] if isinstance(source, dict) else source.get_tensor(key)


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _open_file(path: Path) -> Any:
    """A dict of (memory-mapped) tensors for a torch file, a lazy handle for safetensors."""
    if path.suffix == ".safetensors":
        try:
            from safetensors import safe_open
        except ImportError:
            raise ImportError(f"{path} is a safetensors file: pip install safetensors to read it") from None
        return safe_open(str(path), framework="pt", device="cpu")
    state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    for key in _WRAPPERS:  # e.g. Lightning's {"state_dict": ...}
        if isinstance(state, dict) and isinstance(state.get(key), dict) and not any(
            isinstance(v, torch.Tensor) for v in state.values()
        ):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} holds no state dict of tensors (a dict of name -> tensor); found {type(state).__name__}")
    return state


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """The checkpoint at ``path``: a file, an ``*.index.json`` of a sharded one, or a model directory."""
    path = Path(path)
    if path.is_dir():
        found = next((path / name for name in _HF_FILES if (path / name).exists()), None)
        if found is None:
            raise FileNotFoundError(
                f"{path} is a directory without a model checkpoint in it: expected one of {', '.join(_HF_FILES)} "
                "(a Hugging Face model directory), or a torch.distributed.checkpoint directory (with .metadata)"
            )
        path = found
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if path.name.endswith(".index.json"):
        weight_map = json.loads(path.read_text())["weight_map"]
        return Checkpoint(path, {key: path.parent / file for key, file in weight_map.items()})
    source = _open_file(path)
    checkpoint = Checkpoint(path, dict.fromkeys(source.keys(), path))
    checkpoint._open[path] = source
    return checkpoint


def match_keys(model: nn.Module, shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> dict[str, str]:
    """Which checkpoint key fills each of ``model``'s parameters and persistent buffers, as the
    model's own ``load_state_dict`` (and its hooks' renames) would decide: {model key: checkpoint key}.

    ``model`` may be on ``meta``: placeholders travel through its hooks, and the base loader, which
    would copy them, only records where each arrived. A key a hook rebuilds (e.g. by concatenating
    tensors) is not followed and counts as missing.
    """
    placeholders = {key: torch.empty(shape, dtype=dtype, device="meta") for key, (shape, dtype) in shapes.items()}
    by_identity = {id(tensor): key for key, tensor in placeholders.items()}
    arrived: dict[str, str] = {}

    def record(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        persistent = [n for n in module._buffers if n not in module._non_persistent_buffers_set]
        for name in [*module._parameters, *persistent]:
            value = state_dict.get(prefix + name)
            if value is not None and id(value) in by_identity:
                arrived[prefix + name] = by_identity[id(value)]

    base = nn.Module._load_from_state_dict
    nn.Module._load_from_state_dict = record  # type: ignore[assignment,method-assign]
    try:
        model.load_state_dict(placeholders, strict=False)
    finally:
        nn.Module._load_from_state_dict = base  # type: ignore[method-assign]
    return arrived


def model_keys(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every key of ``model``'s state dict with its tensor, tied parameters under each of their names."""
    yield from model.named_parameters(remove_duplicate=False)
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buffer


def tensor_groups(model: nn.Module) -> dict[int, list[str]]:
    """The model's state-dict keys grouped by tensor: a tied parameter's names together."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model_keys(model):
        groups.setdefault(id(tensor), []).append(name)
    return groups


class MappedReader(FileSystemReader):
    """A ``torch.distributed.checkpoint`` reader that maps each file and reads a stored tensor through a
    view of its pages, so a rank copies the rows it asks for and holds no second copy beside its shard
    (torch's own reader loads each stored tensor whole first). Items stored with a transform (e.g.
    compressed) and non-tensor items go through torch's reader."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        mapped: list[Any] = []
        other: list[Any] = []
        for item in plan.items:
            plain = item.type != LoadItemType.BYTE_IO and not self.storage_data[item.storage_index].transform_descriptors
            (mapped if plain and type(self.fs) is FileSystem else other).append(item)
        if other:
            super().read_data(dataclasses.replace(plan, items=other), planner).wait()
        files: dict[str, tuple[Any, Any]] = {}
        try:
            for item in mapped:
                stored = self._stored_tensor(item, files)
                target = planner.resolve_tensor(item).detach()
                for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                    stored = stored.narrow(dim, offset, length)  # the part of the stored piece asked for
                target.copy_(stored)
                planner.commit_tensor(item, target)
        finally:
            for stream, _ in files.values():
                stream.close()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _stored_tensor(self, item: Any, files: dict[str, tuple[Any, Any]]) -> torch.Tensor:  # (open file, its mapped storage)
        info = self.storage_data[item.storage_index]
        if info.relative_path not in files:
            path = self.fs.concat_path(self.path, info.relative_path)
            files[info.relative_path] = (open(path, "rb"), torch.UntypedStorage.from_file(os.fspath(path), False, os.path.getsize(path)))
        stream, pages = files[info.relative_path]
        # On meta, torch.load reads only the item's header: dtype, shape and where its bytes start.
        header = torch.load(self._slice_file(stream, info), map_location="meta", weights_only=True)
        start = info.offset + header.untyped_storage()._checkpoint_offset
        data = pages[start:start + header.untyped_storage().nbytes()]
        return torch.empty(0, dtype=header.dtype).set_(data, header.storage_offset(), header.shape, header.stride())
