"""One consolidated checkpoint written from a sharded model a tensor at a time.

For code inside the ranks (it imports torch). Gathering the whole state dict
first (``get_model_state_dict(full_state_dict=True)``) holds the model on rank
0 and then a second copy while ``torch.save`` writes it. Here the file's layout
is known before any tensor is gathered (keys, shapes and dtypes are those of the
sharded tensors), so rank 0 writes its skeleton first and then each tensor as
soon as it is gathered, and lets it go: rank 0 holds its shard and one tensor.

Both formats are the ordinary ones: a ``torch.save`` zip file (what
``torch.load(weights_only=True)`` reads) and a ``.safetensors`` file.
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import struct
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from nbshard.rank.scatter import gather_to_rank0

__all__ = ["write_consolidated"]


def write_consolidated(entries: list[tuple[str, torch.Tensor, str]], path: str | os.PathLike[str]) -> None:
    """Write ``entries`` (key, tensor: a sharded DTensor or plain, and which tensor it is: tied keys
    name the same one; the same order on every rank) as one checkpoint at ``path`` on rank 0.
    Collective: every rank gathers each tensor."""
    path = os.fspath(path)
    writer_type = _SafetensorsWriter if path.endswith(".safetensors") else _TorchFileWriter
    writer = writer_type(path, entries) if dist.get_rank() == 0 else None
    try:
        for index, full in _gathered(entries):
            if writer is not None and full is not None:  # rank 0's
                writer.write(index, full)
            del full
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        writer.close()


def _gathered(entries: list[tuple[str, torch.Tensor, str]]) -> Iterator[tuple[int, torch.Tensor | None]]:
    """Each distinct tensor, whole on rank 0's CPU (None on the others), once, in order; its
    index is that of its first entry."""
    seen: set[str] = set()
    rank0 = dist.get_rank() == 0
    for index, (_, tensor, which) in enumerate(entries):
        if which in seen:
            continue
        seen.add(which)
        full = gather_to_rank0(tensor) if isinstance(tensor, DTensor) else tensor
        yield index, _alone(full.detach().to("cpu")) if rank0 and full is not None else None
        del full  # before the next one is gathered


def _alone(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with a storage of its own, exactly its size (a view of padded rows is copied)."""
    if tensor.is_contiguous() and tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _shape_and_dtype(tensor: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    return tuple(tensor.shape), tensor.dtype  # a DTensor's shape is the whole tensor's


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


class _StorageRef:
    """A storage the skeleton refers to, written later under ``data/<key>``."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _Pending:
    """A tensor of the skeleton: pickled as ``torch.save`` pickles a contiguous CPU tensor."""

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape


class _SkeletonPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.dtype])
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _Pending):
            return torch._utils._rebuild_tensor_v2, (
                obj.storage, 0, obj.shape, _contiguous_stride(obj.shape), False, collections.OrderedDict(),
            )
        return NotImplemented


class _TorchFileWriter:
    """``torch.save``'s zip format: the pickled dict first, then each storage's bytes as it comes
    (the records ``torch.serialization._save`` writes, in the same order)."""

    def __init__(self, path: str, entries: list[tuple[str, torch.Tensor, str]]) -> None:
        self._path = path
        self._storage_keys: dict[int, str] = {}  # entry index -> its storage's record
        skeleton: dict[str, _Pending] = {}
        first_of: dict[str, _Pending] = {}
        for index, (key, tensor, which) in enumerate(entries):
            if which not in first_of:
                shape, dtype = _shape_and_dtype(tensor)
                numel = 1
                for size in shape:
                    numel *= size
                storage = _StorageRef(str(len(self._storage_keys)), dtype, numel)
                self._storage_keys[index] = storage.key
                first_of[which] = _Pending(storage, shape)
            skeleton[key] = first_of[which]  # tied: one storage under both keys, as torch.save does
        data = io.BytesIO()
        _SkeletonPickler(data, protocol=2).dump(skeleton)  # torch.save's default protocol
        self._opened = torch.serialization._open_zipfile_writer(path)
        self._zip = self._opened.__enter__()
        self._zip.write_record("data.pkl", data.getvalue(), len(data.getvalue()))
        self._zip.write_record(".format_version", "1", len("1"))
        alignment = str(torch.serialization._get_storage_alignment())
        self._zip.write_record(".storage_alignment", alignment, len(alignment))
        self._zip.write_record("byteorder", sys.byteorder, len(sys.byteorder))

    def write(self, index: int, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        self._zip.write_record(f"data/{self._storage_keys[index]}", storage, storage.nbytes())

    def close(self) -> None:
        self._opened.__exit__(None, None, None)

    def abort(self) -> None:
        self._opened.__exit__(None, None, None)
        os.unlink(self._path)


_SAFETENSORS_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


class _SafetensorsWriter:
    """The safetensors format: a JSON header with every tensor's offsets, then the bytes. A tied
    tensor is written under each of its keys (safetensors has no aliases), its copies right after
    one another, so no tensor waits in memory for its turn."""

    def __init__(self, path: str, entries: list[tuple[str, torch.Tensor, str]]) -> None:
        first_index: dict[str, int] = {}
        self._keys_of: dict[int, list[str]] = collections.defaultdict(list)  # first entry index -> keys
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for index, (key, tensor, which) in enumerate(entries):
            shape, dtype = shapes[key] = _shape_and_dtype(tensor)
            if dtype not in _SAFETENSORS_NAMES:
                raise ValueError(f"save_full: {key} is a {dtype} tensor, which safetensors cannot hold; save to a .pt path")
            self._keys_of[first_index.setdefault(which, index)].append(key)
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for keys in self._keys_of.values():  # the order the tensors are gathered in
            for key in keys:
                shape, dtype = shapes[key]
                size = torch.empty((), dtype=dtype).element_size()
                for dim in shape:
                    size *= dim
                header[key] = {"dtype": _SAFETENSORS_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
                offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts on an 8-byte boundary
        self._written = 0
        self._path = path
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close() or abort()
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, index: int, tensor: torch.Tensor) -> None:
        data = tensor.reshape(-1).view(torch.uint8).numpy().data  # a memoryview of its bytes
        for _ in self._keys_of[index]:
            self._file.write(data)
            self._written += 1

    def close(self) -> None:
        self._file.close()
        expected = sum(map(len, self._keys_of.values()))
        if self._written != expected:
            raise RuntimeError(f"save_full wrote {self._written} of {expected} tensors to {self._path}")

    def abort(self) -> None:
        self._file.close()
        os.unlink(self._path)

