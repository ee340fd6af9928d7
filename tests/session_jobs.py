"""Functions that tests run in a session's ranks (imported by name in the ranks)."""

from __future__ import annotations

import os
import time


def rank() -> int:
    return int(os.environ["RANK"])


def pid() -> int:
    return os.getpid()


def length(data: bytes) -> int:
    return len(data)


def bytes_by_rank(sizes: list[int]) -> bytes:
    return b"x" * sizes[int(os.environ["RANK"])]


def init_gloo() -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.get_world_size()


def remember(value: object) -> None:
    global remembered
    remembered = value


def recall() -> object:
    return remembered


def raise_everywhere() -> None:
    raise ValueError(f"a bad learning rate in rank {rank()}")


def raise_on_rank_1() -> str:
    if rank() == 1:
        raise ValueError("only rank 1 raised")
    return "rank 0 returned"


def count_then_return_a_lock() -> object:
    """Runs to its end in every rank, and returns what cannot be pickled."""
    import threading

    global counted
    counted = globals().get("counted", 0) + 1
    return threading.Lock()


def counted_so_far() -> int:
    return counted


def raise_on_rank_1_while_rank_0_waits() -> None:
    import torch.distributed as dist

    if rank() == 1:
        raise ValueError("rank 1 raised before the barrier")
    dist.barrier()


def raise_on_rank_0_after_the_session_was_lost(late: float) -> None:
    """Rank 1 raises; rank 0 outlives the grace the session gives it, ignores SIGTERM (only
    SIGKILL stops it) and raises ``late`` seconds in: an answer after the session was lost."""
    import signal

    if rank() == 1:
        raise ValueError("rank 1 raised first")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(late)
    raise RuntimeError("rank 0 raised after the session was lost")


def sleep_long() -> None:
    print("sleeping", flush=True)
    time.sleep(120)


def barrier_on_rank_0_sleep_on_rank_1() -> None:
    """Rank 0 waits in a collective that rank 1 never joins; rank 1 sleeps in Python."""
    import torch.distributed as dist

    print("waiting", flush=True)
    if rank() == 0:
        dist.barrier()
    time.sleep(120)


def extra_collective_on_rank_0() -> None:
    import torch
    import torch.distributed as dist

    if rank() == 0:
        dist.all_reduce(torch.ones(1), async_op=True)


def killed_on_rank_1() -> None:
    if rank() == 1:
        os.kill(os.getpid(), 9)
    time.sleep(120)


def all_reduce_sum() -> float:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank() + 1)])
    dist.all_reduce(value)
    return float(value)


def log_two_steps() -> None:
    import nbshard

    for step in (1, 2):
        nbshard.log_metrics(step=step, loss=1.0 / step)


def hold_cuda_tensor() -> dict:
    """NCCL in a session: a CUDA tensor kept in the rank between calls, and the collective count."""
    global held
    import torch

    import nbshard
    from nbshard.process.session_rank import collectives_issued

    if not torch.distributed.is_initialized():
        nbshard.init_process_group()
    held = torch.ones(1 << 20, device=nbshard.device())  # 4 MiB that stays on the GPU
    torch.distributed.all_reduce(held)
    return {"backend": torch.distributed.get_backend(), "collectives": collectives_issued(),
            "allocated": torch.cuda.memory_allocated()}


def cuda_tensor_sum() -> float:
    import torch

    torch.distributed.all_reduce(held)
    return float(held[0])
