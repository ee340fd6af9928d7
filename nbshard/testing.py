"""A pytest plugin for testing your own training functions on N CPU ranks.

Opt in with ``pytest -p nbshard.testing`` or ``pytest_plugins = ["nbshard.testing"]``
in a ``conftest.py``; it is never loaded on its own and imports no torch.

    def test_my_step(run_on_ranks):
        losses = run_on_ranks(my_train_step, cfg, nproc=2)   # every rank's value
        assert all(loss < 1.0 for loss in losses)

Ranks run through the subprocess backend with every GPU hidden, so
``nbshard.init_process_group()`` picks gloo, and a failing rank raises
``nbshard.JobFailed`` with its traceback, as in a notebook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import nbshard

__all__ = ["DEFAULT_TIMEOUT", "run_on_ranks"]

DEFAULT_TIMEOUT = 300.0


def _run_on_ranks(fn: Callable[..., Any], *args: Any, nproc: int = 2, timeout: float = DEFAULT_TIMEOUT, **options: Any) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` CPU ranks with gloo; returns every rank's value."""
    return nbshard.run(fn, *args, nproc=nproc, gpus=(), return_all=True, timeout=timeout, **options)


@pytest.fixture
def run_on_ranks() -> Callable[..., list[Any]]:
    """``run_on_ranks(fn, *args, nproc=2, timeout=300, **options) -> [value of each rank]``."""
    return _run_on_ranks
