"""The environment of a job's launcher and ranks: the kernel's, less Jupyter's own variables,
plus what torchrun sets for each rank; and the part a fork of the warm process cannot change.

Pure: a function of the mappings it is given, which a test can call and compare.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

__all__ = [
    "APPLIED_AT_FORK",
    "TORCHRUN_VARIABLES",
    "import_time_environment",
    "launch_environment",
    "rank_environment",
    "without_rays_debugger",
]

# What torchrun's elastic agent sets for each worker (torch/distributed/elastic/
# agent/server/local_elastic_agent.py); Lightning's TorchElasticEnvironment and
# Accelerate detect an external launcher from these.
TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "NODE_RANK",  # not torchrun's: Lightning's and accelerate's name for GROUP_RANK, set alike
)

# Variables a Jupyter kernel sets for itself (JPY_PARENT_PID, JPY_SESSION_NAME, ...).
_KERNEL_ONLY_PREFIX = "JPY_"



class _ErrorFiles(Protocol):
    """Where a rank's torchelastic error file goes (``nbshard.run_dir.RunDir``)."""

    def torchelastic_error(self, rank: int) -> Path: ...


def launch_environment(
    kernel_env: Mapping[str, str], *, gpus: Sequence[int | str] | None, extra: Mapping[str, str]
) -> dict[str, str]:
    """The environment shared by the launcher and all ranks of a job.

    The kernel's environment minus Jupyter's own variables and any torchrun
    variables it happened to have, plus the job's GPUs and extra variables.
    """
    env = {
        k: v for k, v in kernel_env.items() if not k.startswith(_KERNEL_ONLY_PREFIX) and k not in TORCHRUN_VARIABLES
    }
    # ipykernel selects its inline plotting backend, which does not exist outside a kernel.
    if env.get("MPLBACKEND", "").startswith("module://matplotlib_inline"):
        del env["MPLBACKEND"]
    env = without_rays_debugger(env)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def without_rays_debugger(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the ``PYTHONBREAKPOINT`` Ray sets in its own processes (``ray.init()`` in
    the kernel, and in every actor): ranks are not Ray's driver or workers, and there Ray's
    debugger raised inside Ray where nbshard's should take the ``breakpoint()``."""
    return {k: v for k, v in env.items() if not (k == "PYTHONBREAKPOINT" and v.startswith("ray.util.rpdb."))}


def rank_environment(
    base_env: Mapping[str, str],
    *,
    rank: int,
    nproc: int,
    master_port: int,
    run_id: str,
    run_dir: _ErrorFiles,
    restart_count: int = 0,
    max_restarts: int = 0,
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    nnodes: int = 1,
) -> dict[str, str]:
    """The environment of one rank: ``base_env`` plus what torchrun would set. ``rank`` is the
    rank on its node (``LOCAL_RANK``), ``nproc`` the ranks per node."""
    global_rank, world_size = node_rank * nproc + rank, nnodes * nproc
    env = dict(base_env)
    env.update(
        RANK=str(global_rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK=str(node_rank),
        NODE_RANK=str(node_rank),
        GROUP_WORLD_SIZE=str(nnodes),
        ROLE_RANK=str(global_rank),
        ROLE_WORLD_SIZE=str(world_size),
        ROLE_NAME="default",
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_RESTART_COUNT=str(restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(max_restarts),
        TORCHELASTIC_USE_AGENT_STORE="False",
        TORCHELASTIC_ERROR_FILE=str(run_dir.torchelastic_error(global_rank)),
    )
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if nproc > 1:
        # torchrun does the same: N ranks each using every core oversubscribe the CPU.
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


# Variables that a process reads once, when the interpreter starts or a library is imported:
# a process forked from the warm process keeps the warm process's values of these.
_IMPORT_TIME_PREFIXES = (
    "PYTHON", "LC_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "GOTO_", "BLIS_", "TORCH", "PYTORCH_",
    "LD_", "MALLOC_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "LIGHTNING_", "PL_", "NUMEXPR_",
)
_IMPORT_TIME_NAMES = {"LANG", "LANGUAGE", "GLIBC_TUNABLES", "TZ"}
_READ_LATER_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_", "TORCHINDUCTOR_", "TORCH_COMPILE_")  # per run, or read at use
_READ_LATER_NAMES = {"PYTHONBREAKPOINT"}  # read at each breakpoint()
APPLIED_AT_FORK = ("OMP_NUM_THREADS",)  # a plain count is applied with torch.set_num_threads


def import_time_environment(env: Mapping[str, str], preload: Sequence[str] = ()) -> dict[str, str]:
    """The part of ``env`` read at start-up or import time (by Python, the C library, OpenMP,
    the BLAS libraries, torch and the preloaded packages, whose upper-cased names count as
    prefixes): a fork of a process started with other values would not see this ``env``."""
    prefixes = _IMPORT_TIME_PREFIXES + tuple(f"{name.split('.')[0].upper()}_" for name in preload)
    return {
        name: value for name, value in env.items()
        if (name in _IMPORT_TIME_NAMES or name.startswith(prefixes))
        and name not in TORCHRUN_VARIABLES and name not in _READ_LATER_NAMES and not name.startswith(_READ_LATER_PREFIXES)
        and not (name in APPLIED_AT_FORK and value.isdigit() and int(value) > 0)
    }
