"""Rank programs for restarts: a training loop that saves a checkpoint every step and resumes
from it, as a job run with max_restarts should. Ranks import this module by name."""

from __future__ import annotations

import os
import time
from pathlib import Path


def train_with_checkpoints(folder, steps, fail_at_step, fail_on_rank, failing_attempts):
    """Each step all-reduces ``step + 1``; rank 0 saves ``{step, total}`` after it. In the first
    ``failing_attempts`` attempts, ``fail_on_rank`` raises at ``fail_at_step``. Every attempt
    resumes from the last checkpoint."""
    import torch
    import torch.distributed as dist

    import nbshard

    nbshard.init_process_group()
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    path = Path(folder) / "checkpoint.pt"
    state = torch.load(path, weights_only=True) if path.exists() else {"step": 0, "total": 0.0}
    resumed_from = state["step"]
    print(f"rank {rank}: attempt {attempt} starts at step {resumed_from}", flush=True)
    dist.barrier()  # every rank has read the checkpoint before rank 0 writes the next one
    for step in range(resumed_from, steps):
        if attempt < failing_attempts and rank == fail_on_rank and step == fail_at_step:
            raise RuntimeError(f"boom at step {step} in attempt {attempt}")
        value = torch.tensor([float(step + 1)])
        dist.all_reduce(value)
        state = {"step": step + 1, "total": state["total"] + value.item()}
        if rank == 0:
            torch.save(state, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
        dist.barrier()
    return {
        **state, "resumed_from": resumed_from, "restart_count": attempt,
        "max_restarts": int(os.environ["TORCHELASTIC_MAX_RESTARTS"]),
    }


def killed_in_first_attempt(signum):
    """Rank 1 dies by ``signum`` in the first attempt; every rank returns its restart count after."""
    import signal

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0 and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.Signals(signum))
    return attempt


def fails_in_first_attempt_then_sleeps(marker):
    """The first attempt fails at once; the next one writes ``marker`` and sleeps."""
    if int(os.environ["TORCHELASTIC_RESTART_COUNT"]) == 0:
        raise ValueError("first attempt fails")
    Path(marker).write_text(os.environ["RANK"])
    time.sleep(600)
