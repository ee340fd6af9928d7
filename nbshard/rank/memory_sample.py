"""One memory sample of this process: resident and anonymous memory and their peaks, its
proportional share beside the warm process it was forked from, and GPU memory.

Never initializes CUDA: device memory is read only in a process where CUDA is initialized
already, and NVML (``nvidia-ml-py``), when installed, for what the process really holds on
the device.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import time
from typing import Any

__all__ = ["count_proportional_memory", "sample_memory"]

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_statm: int | None = None  # /proc/self/statm, opened once: a sample is then one pread


def _resident_bytes() -> tuple[int, int, int]:
    """(resident, peak resident, anonymous resident) bytes of this process, in two system calls.

    Resident memory counts file pages too: a memory-mapped checkpoint, torch's libraries.
    Anonymous memory (resident minus file-backed and shared) is what tensors and the heap hold.
    """
    global _statm
    if _statm is None:
        _statm = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
    fields = os.pread(_statm, 128, 0).split()
    resident_pages, file_and_shared_pages = int(fields[1]), int(fields[2])
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    resident = resident_pages * _PAGE_SIZE
    anonymous = max(resident_pages - file_and_shared_pages, 0) * _PAGE_SIZE
    return resident, max(resident, peak_kib * 1024), anonymous  # the kernel updates the peak lazily


class _Peak:
    """The highest value seen in the samples."""

    def __init__(self) -> None:
        self.value = 0

    def __call__(self, value: int) -> int:
        self.value = max(self.value, value)
        return self.value


class _AnonymousPeak(_Peak):
    """Peak anonymous memory, spikes between two samples included.

    Linux keeps no peak of anonymous memory, only of resident memory (``ru_maxrss``, updated
    before memory is unmapped). When that high-water mark rose since the last sample, resident
    memory peaked in between: its anonymous part was the mark minus the file pages, taken at the
    larger of their two sampled sizes, so the figure errs low (it errs high only where a file was
    mapped, read and let go again between two samples).
    """

    def __init__(self) -> None:
        super().__init__()
        self.between = 0  # the last peak found between samples
        self._mark: int | None = None  # the high-water mark and file pages at the last sample
        self._file = 0

    def sample(self, anonymous: int, peak_resident: int, file_pages: int) -> int:
        if self._mark is not None and peak_resident > self._mark:
            self.between = max(peak_resident - max(self._file, file_pages), 0)
            self(self.between)
        self._mark, self._file = peak_resident, file_pages
        return self(anonymous)


_peak_anonymous = _AnonymousPeak()


class _ProportionalMemory:
    """Resident memory with the pages shared with the warm process divided among the processes
    that share them (PSS). A forked rank's resident size counts every page of torch it shares
    with the warm process and its sibling ranks as its own; the proportional share does not.
    Reading smaps_rollup costs milliseconds, so it is read at most once a second, and between
    reads the shared part is taken as unchanged. The peaks come from those reads (an estimate
    from a shared part that has since grown would overstate them), and from a spike between
    samples (see ``sample_memory``)."""

    REFRESH = 1.0

    def __init__(self) -> None:
        self.on = False
        self._read_at = float("-inf")
        self.shared = 0  # resident minus proportional, at the last read
        self.shared_anonymous = 0  # the same for anonymous memory
        self.file_share = 0  # proportional minus anonymous proportional (file pages' share), at the last read
        self.peak = _Peak()
        self.peak_anonymous = _Peak()

    def __call__(self, rss: int, anonymous: int) -> tuple[int, int]:
        """(PSS, anonymous PSS) for this resident and anonymous size."""
        if time.monotonic() - self._read_at >= self.REFRESH:
            pss = pss_anonymous = 0
            with open("/proc/self/smaps_rollup", "rb") as rollup:
                for line in rollup:
                    if line.startswith(b"Pss:"):
                        pss = int(line.split()[1]) * 1024
                        self.shared = max(rss - pss, 0)
                        self.peak(pss)
                    elif line.startswith(b"Pss_Anon:"):
                        pss_anonymous = int(line.split()[1]) * 1024
                        self.shared_anonymous = max(anonymous - pss_anonymous, 0)
                        self.peak_anonymous(pss_anonymous)
            self.file_share = max(pss - pss_anonymous, 0)
            self._read_at = time.monotonic()
        return max(rss - self.shared, 0), max(anonymous - self.shared_anonymous, 0)


_proportional = _ProportionalMemory()


def count_proportional_memory() -> None:
    """Report PSS besides RSS: this process was forked from the warm process."""
    _proportional.on = True


class _NvmlUsage:
    """Device memory this process holds according to NVML (context and NCCL buffers included)."""

    def __init__(self) -> None:
        self._handles: dict[int, Any] | None = None
        self._nvml: Any = None

    def used(self, torch: Any) -> dict[int, int]:
        try:
            if self._handles is None:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
                self._handles = {
                    device: pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(device).uuid}")
                    for device in range(torch.cuda.device_count())
                }
            pid, found = os.getpid(), {}
            for device, handle in self._handles.items():
                for process in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if process.pid == pid and process.usedGpuMemory is not None:
                        found[device] = int(process.usedGpuMemory)
            return found
        except Exception:  # noqa: BLE001 - NVML missing, no permission, or another PID namespace
            self._handles = {}
            return {}


_nvml = _NvmlUsage()


def _imported(name: str) -> Any:
    """The module ``name`` once its import has finished, else None.

    The job's main thread may be importing torch while this thread samples:
    a half-initialized module lacks attributes (``torch.cuda``) until then.
    """
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if module is None or getattr(spec, "_initializing", False):
        return None
    return module


def _gpu_memory() -> list[dict[str, Any]]:
    """Each device's memory, if this process uses CUDA already (never the first to touch it)."""
    torch, cuda = _imported("torch"), _imported("torch.cuda")
    if torch is None or cuda is None or not cuda.is_initialized():
        return []
    used = _nvml.used(torch)
    return [
        {
            "device": device,
            "allocated": cuda.memory_allocated(device),
            "reserved": cuda.memory_reserved(device),
            "peak_allocated": cuda.max_memory_allocated(device),
            "used": used.get(device),
        }
        for device in range(cuda.device_count())
    ]


def sample_memory() -> dict[str, Any]:
    """This process's resident memory and, if it uses CUDA already, each device's memory.

    Never raises for the GPU part: whatever goes wrong there (torch half
    imported, a driver error) means a sample without GPU figures.
    """
    rss, peak_rss, anonymous = _resident_bytes()
    try:
        gpus = _gpu_memory()
    except Exception:  # noqa: BLE001 - telemetry must never fail or print into the job
        gpus = []
    peak_anonymous = _peak_anonymous.sample(anonymous, peak_rss, rss - anonymous)
    sample = {"rss": rss, "peak_rss": peak_rss, "anon": anonymous, "peak_anon": peak_anonymous, "gpus": gpus}
    if _proportional.on:
        with contextlib.suppress(OSError, ValueError):
            pss, anonymous_pss = _proportional(rss, anonymous)
            # A spike between samples is the rank's own memory: shared pages were there before it.
            # It counts in both proportional peaks: the whole adds the last read's share of file
            # pages, so it never falls below the anonymous part. Both err low, never high: the
            # anonymous pages shared with the warm process only get fewer (copy on write), and
            # file pages faulted in since the read are left out.
            spike = _peak_anonymous.between - _proportional.shared_anonymous
            _proportional.peak_anonymous(spike)
            _proportional.peak(spike + _proportional.file_share)
            sample.update(pss=pss, peak_pss=_proportional.peak.value, pss_anon=anonymous_pss,
                          peak_pss_anon=_proportional.peak_anonymous.value)
    return sample
