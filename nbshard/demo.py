"""``python -m nbshard demo``: one small sharded training job end to end, and what it did.

A new user's second command after the install: it starts ranks outside this process, builds
a model with only each rank's shard in memory (``build_sharded``), trains it with FSDP2,
writes one full checkpoint from rank 0, and prints what happened with the figures it saw.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

__all__ = ["main", "train"]


def train(steps: int, checkpoint: str) -> dict[str, Any]:
    """The job: runs in every rank (it imports torch; the calling process does not)."""
    import torch
    import torch.distributed as dist

    import nbshard
    from torch.distributed.tensor import DTensor

    from nbshard.rank import fsdp

    nbshard.init_process_group()
    rank, device = dist.get_rank(), nbshard.device()
    torch.manual_seed(0)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)) for _ in range(4)
            )
            self.head = torch.nn.Linear(64, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = x + layer(x)
            return self.head(x)

    model = fsdp.build_sharded(Model)
    total = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the whole tensor's
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    target = torch.nn.Linear(64, 1).to(device)  # a function to learn, the same in every rank
    losses = []
    for step in range(steps):
        x = torch.randn(128, 64, device=device)
        with torch.no_grad():
            y = target(x)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / dist.get_world_size())
        nbshard.log_metrics(step, loss=losses[-1])
        if rank == 0 and (step % 5 == 0 or step == steps - 1):
            print(f"step {step:2d}  loss {losses[-1]:.4f}")
    fsdp.save_full(model, checkpoint)
    return {"rank": rank, "device": str(device), "backend": dist.get_backend(), "parameters": total,
            "local_parameters": local, "losses": losses}


def main(argv: list[str] | None = None) -> int:
    import nbshard

    parser = argparse.ArgumentParser(prog="python -m nbshard demo", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: one per GPU, or 2 on the CPU)")
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    args = parser.parse_args(argv)
    from nbshard.kernel.gpus import visible_gpu_count

    gpus = visible_gpu_count(os.environ)
    nproc = args.nproc or max(gpus, 2)
    where = f"{nproc} GPUs (NCCL)" if gpus >= nproc else f"{nproc} ranks on the CPU (gloo)"
    print(f"nbshard demo: training a small model sharded with FSDP2 across {where}, in processes started outside this one.")
    with tempfile.TemporaryDirectory(prefix="nbshard-demo-") as folder:
        checkpoint = os.path.join(folder, "model.pt")
        started = time.monotonic()
        handle = nbshard.submit(train, args.steps, checkpoint, nproc=nproc, return_all=True, name="demo")
        handle.watch()
        results = handle.result()
        elapsed = time.monotonic() - started
        size = os.path.getsize(checkpoint)
    first = results[0]
    print()
    print(f"nbshard works. In {elapsed:.1f} s ({'warm' if handle.warm else 'cold'} start):")
    imported = "this process imported torch itself" if "torch" in sys.modules else "this process imported no torch"
    print(f"  - {nproc} ranks ran outside this process ({first['backend']} on {first['device'].split(':')[0]}); {imported}.")
    shards = ", ".join(f"rank {r['rank']} {r['local_parameters']:,}" for r in results)
    print(f"  - build_sharded gave each rank only its shard of the {first['parameters']:,} parameters ({shards}).")
    print(f"  - {args.steps} steps of FSDP2 training: loss {first['losses'][0]:.4f} -> {first['losses'][-1]:.4f}.")
    print(f"  - save_full wrote one plain checkpoint from rank 0 ({size / 2**10:.0f} KiB; removed again).")
    print(f"  - every rank's log: {handle.run_dir}")
    print("Next: open notebooks/quickstart_ddp.ipynb in Jupyter, or see the README's Quickstart.")
    return 0
