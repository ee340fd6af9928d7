"""Serialization of a rank's results (ranks to kernel).

Results move tensors to the CPU first, so loading a result never creates a CUDA context
in the kernel; a dense tensor travels as its raw bytes; a DTensor is refused with what to do.
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any

from nbshard.files import write_atomic_with
from nbshard.pickling import Pickler, describe_unpicklable, find_unpicklable

__all__ = ["RESULT_HINT", "dump_result", "write_result"]

RESULT_HINT = (
    "Likely cause: the value holds an object tied to the rank's process (a lock, an open file, a "
    "process group, a DataLoader, a Trainer holding them). What to do: bring back what can travel "
    "(model.state_dict(), tensors, numbers, plain data), or save it to a file in the rank and load "
    "that in the notebook."
)


class _DTensorResult(TypeError):
    pass


class _ResultPickler(Pickler):
    """Moves tensors to the CPU and refuses DTensors, which only make sense across ranks."""

    set_up_again = False  # what it pickles is for the kernel

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
            if dtensor is not None and isinstance(obj, dtensor):
                raise _DTensorResult(
                    "the result holds a DTensor (a sharded tensor, e.g. an FSDP2 parameter), "
                    "which means nothing outside the ranks. Gather it first with "
                    "tensor.full_tensor() (a collective every rank must call), or return "
                    "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, "
                    "cpu_offload=True)) from rank 0."
                )
            reduced = _tensor_as_buffer(torch, obj)
            if reduced is not None:
                return reduced
            if obj.device.type not in ("cpu", "meta"):
                cpu = obj.detach().cpu()
                if isinstance(obj, torch.nn.Parameter):
                    cpu = torch.nn.Parameter(cpu, requires_grad=obj.requires_grad)
                return cpu.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return super().reducer_override(obj)


def _tensor_as_buffer(torch: Any, tensor: Any) -> Any:
    """A dense tensor (on the CPU once moved there) pickled as its raw bytes, written straight
    from its memory and read back into one buffer the tensor then uses: about its own size on
    each side, where torch's own pickling holds three copies. None for other kinds of tensor."""
    plain = type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.layout == torch.strided
    if not plain or tensor.device.type == "meta" or tensor.is_quantized or tensor.is_conj() or tensor.is_neg():
        return None
    try:
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError):  # no numpy here, or a dtype numpy cannot view
        return None
    dtype = str(tensor.dtype).removeprefix("torch.")
    parameter = isinstance(tensor, torch.nn.Parameter)
    return _tensor_from_buffer, (pickle.PickleBuffer(raw), dtype, tuple(tensor.shape), tensor.requires_grad, parameter)


def _tensor_from_buffer(buffer: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool, parameter: bool) -> Any:
    import torch

    if not isinstance(buffer, bytearray):  # read-only memory would make torch warn, and copy anyway
        buffer = bytearray(buffer)
    flat = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)
    tensor = flat.view(getattr(torch, dtype)).reshape(shape)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_() if requires_grad else tensor


def write_result(path: Any, value: Any, keep_small: int | None = None) -> bytes | None:
    """Pickle a rank's result straight into ``path`` (atomically); TypeError naming the culprit.
    With ``keep_small``: a result of at most that many bytes is returned instead (no file made)."""
    return write_atomic_with(path, lambda file: _dump_result_into(file, value, "the returned value"), keep_small=keep_small)


def dump_result(value: Any, path: str = "the returned value") -> bytes:
    """The pickled result of a rank as bytes; TypeError naming the culprit (under ``path``)."""
    buffer = io.BytesIO()
    _dump_result_into(buffer, value, path)
    return buffer.getvalue()


def _dump_result_into(file: Any, value: Any, path: str) -> None:
    try:
        _ResultPickler(file, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except _DTensorResult as error:
        raise TypeError(f"Cannot send {path} back: {error}") from None
    except Exception as error:
        found = find_unpicklable(value, path)
        if found is not None:
            raise TypeError(describe_unpicklable(found, "Cannot send the result back", RESULT_HINT)) from None
        raise TypeError(f"Cannot send {path} back: {error}. {RESULT_HINT}") from None
