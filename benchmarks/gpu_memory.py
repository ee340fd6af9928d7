"""Do nbshard's GPU figures match nvidia-smi? One rank holds a known amount of device memory.

While the rank holds it, this script polls ``nvidia-smi --query-compute-apps`` for the
rank's PID; then it prints nvidia-smi's peak beside the peaks nbshard reports
(``gpu_peak_used``: NVML per process, context and allocator cache included;
``gpu_peak_allocated``: torch's tensors) and the live view's figure.

Usage: python benchmarks/gpu_memory.py [GiB]   (default 4; needs a CUDA GPU and nvidia-smi)
"""

from __future__ import annotations

import subprocess
import sys
import time

import nbshard
from nbshard.kernel.telemetry import shown_bytes

MiB = 2**20


def hold(gib: float, seconds: float) -> int:
    import os
    import time

    import torch

    import nbshard

    block = torch.ones(int(gib * 2**30) // 4, device=nbshard.device())  # float32
    torch.cuda.synchronize()
    time.sleep(seconds)
    del block
    return os.getpid()


def smi_used_by_pid() -> dict[int, int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout
    used = {}
    for line in out.splitlines():
        pid, mib = (field.strip() for field in line.split(","))
        if pid.isdigit() and mib.isdigit():
            used[int(pid)] = int(mib) * MiB
    return used


def main(gib: float = 4.0) -> None:
    handle = nbshard.submit(hold, gib, 4.0, nproc=1, sample_interval=0.2, show_ranks=[])
    smi_peaks: dict[int, int] = {}
    try:
        while not handle.done():
            for pid, used in smi_used_by_pid().items():
                smi_peaks[pid] = max(used, smi_peaks.get(pid, 0))
            time.sleep(0.2)
    finally:
        handle.cancel()  # nothing left running if nvidia-smi fails
    pid = handle.result()
    peaks = handle.peak_memory()[0]
    smi = smi_peaks.get(pid)
    print(f"one rank holding {gib:g} GiB of float32 on the GPU (pid {pid})")
    print(f"  nvidia-smi peak for the rank       {smi / MiB if smi else float('nan'):9.0f} MiB")
    print(f"  nbshard gpu_peak_used (NVML)       {(peaks['gpu_peak_used'] or 0) / MiB:9.0f} MiB")
    print(f"  nbshard gpu_peak_allocated (torch) {(peaks['gpu_peak_allocated'] or 0) / MiB:9.0f} MiB")
    print(f"  nbshard gpu_reserved at its highest {max(r['gpu_reserved'] or 0 for r in handle.memory()) / MiB:8.0f} MiB")
    label, value = max((shown_bytes(r) for r in handle.memory()), key=lambda shown: shown[1])
    print(f"  live view's figure at its highest  {value / MiB:9.0f} MiB ({label})")
    if smi:
        print(f"  ratio nbshard NVML / nvidia-smi    {(peaks['gpu_peak_used'] or 0) / smi:9.3f}")
    print(f"  processes nvidia-smi saw: {sorted(smi_peaks)}; the kernel (pid {__import__('os').getpid()}) among them: "
          f"{__import__('os').getpid() in smi_peaks}")


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 4.0)
