"""Per-rank peak memory of loading and sharding a ~1B-parameter model on 2 ranks.

Naive (the full model on every rank, then fully_shard) against nbshard.fsdp.build_sharded
from scratch, from a full checkpoint only rank 0 reads (memory-mapped), and from a sharded
checkpoint. Each figure is the rank's peak anonymous resident memory (RssAnon, sampled
every 2 ms; the page cache of a memory-mapped file is reclaimable and not counted) above
its baseline after `import torch` and `init_process_group`, as a fraction of the full
model's size. On GPUs it also reports torch.cuda.max_memory_allocated.

Usage: python benchmarks/sharded_loading_memory.py [width] [depth]   (default 2048 32: 1.07B)
"""

from __future__ import annotations

import sys
import tempfile

import nbshard


def build_model(width: int, depth: int):
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(width, 4 * width)
            self.down = torch.nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    return torch.nn.Sequential(torch.nn.ModuleList(Block() for _ in range(depth)))


def measure(mode: str, width: int, depth: int, folder: str) -> dict:
    import time

    import torch
    from peak_memory import PeakAnonymousMemory
    from torch.distributed.fsdp import fully_shard

    import nbshard
    from nbshard import fsdp

    nbshard.init_process_group()
    started = time.perf_counter()
    build = lambda: build_model(width, depth)  # noqa: E731
    with PeakAnonymousMemory() as peak:
        if mode == "naive":
            model = build().to(nbshard.device())
            for block in model[0]:
                fully_shard(block)
            fully_shard(model)
        elif mode == "helper, from scratch":
            model = fsdp.build_sharded(build, seed=0)
        elif mode == "helper, full checkpoint on rank 0":
            model = fsdp.build_sharded(build, full_checkpoint=f"{folder}/full.pt")
        else:
            model = fsdp.build_sharded(build, sharded_checkpoint=f"{folder}/sharded")
    seconds = time.perf_counter() - started
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # global sizes (DTensor)
    if mode == "helper, from scratch":
        fsdp.save_sharded(model, f"{folder}/sharded")
    cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return {"peak_above_baseline": peak.above_baseline, "model_bytes": full_bytes, "seconds": seconds, "cuda_peak": cuda}


def write_full_checkpoint(width: int, depth: int, path: str) -> int:
    import torch

    torch.manual_seed(0)
    model = build_model(width, depth)
    torch.save(model.state_dict(), path)
    return sum(p.numel() for p in model.parameters())


def main(width: int = 2048, depth: int = 32) -> None:
    with tempfile.TemporaryDirectory(prefix="nbshard-bench-") as folder:
        params = nbshard.run(write_full_checkpoint, width, depth, f"{folder}/full.pt", nproc=1, show_ranks=[])
        print(f"model: {params / 1e9:.2f}B parameters, fp32 ({params * 4 / 2**30:.2f} GiB); 2 ranks")
        modes = ["naive", "helper, from scratch", "helper, full checkpoint on rank 0", "helper, sharded checkpoint"]
        for mode in modes:
            results = nbshard.run(measure, mode, width, depth, folder, nproc=2, return_all=True, show_ranks=[])
            fractions = [r["peak_above_baseline"] / r["model_bytes"] for r in results]
            line = (
                f"  {mode:36s} peak per rank above baseline: "
                + ", ".join(f"{r['peak_above_baseline'] / 2**30:.2f} GiB" for r in results)
                + f"  = {', '.join(f'{f:.2f}' for f in fractions)} of the model  ({max(r['seconds'] for r in results):.1f} s)"
            )
            if results[0]["cuda_peak"] is not None:
                line += "  CUDA peak " + ", ".join(f"{r['cuda_peak'] / 2**30:.2f} GiB" for r in results)
            print(line, flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
