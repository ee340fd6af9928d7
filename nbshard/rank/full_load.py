"""A sharded model filled from one full checkpoint that rank 0 alone reads.

For code inside the ranks (it imports torch). Rank 0 opens the checkpoint, plans which of
its keys fills which of the model's tensors (through the model's own load hooks, with the
base model's prefix added or removed as ``from_pretrained`` does), checks that they fit,
and sends each rank its rows a tensor at a time; every rank raises together when they do
not fit, with the keys named.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nbshard.rank.checkpoints import Checkpoint, match_keys, model_keys, open_checkpoint, tensor_groups
from nbshard.rank.scatter import scatter_into

__all__ = ["describe_mismatch", "load_full_from_rank0", "mismatch"]


def mismatch(expected: dict[str, torch.Size], found: dict[str, torch.Size], what: str) -> str | None:
    """A message naming missing, unexpected and reshaped keys; None when they agree."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    reshaped = {k: (found[k], expected[k]) for k in sorted(set(expected) & set(found)) if tuple(expected[k]) != tuple(found[k])}
    return describe_mismatch(what, missing, unexpected, reshaped)


def describe_mismatch(
    what: str, missing: list[str], unexpected: list[str], reshaped: dict[str, tuple[torch.Size, torch.Size]], hint: str = ""
) -> str | None:
    if not (missing or unexpected or reshaped):
        return None
    parts = [f"{what} does not match the model."]
    if missing:
        parts.append(f"Missing from it: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}.")
    if unexpected:
        parts.append(f"Not in the model: {', '.join(unexpected[:10])}{' ...' if len(unexpected) > 10 else ''}.")
    for key, (found, expected) in list(reshaped.items())[:10]:
        parts.append(f"{key}: the checkpoint has shape {tuple(found)}, the model {tuple(expected)}.")
    parts.append(hint or "Check that build() makes the model the checkpoint was saved from.")
    return " ".join(parts)


def _plan_full_load(model: nn.Module, template: nn.Module, checkpoint: Checkpoint, strict: bool) -> dict[str, Any]:
    """On rank 0: which checkpoint key fills each of the model's tensors (tied ones once), which it
    lacks, and a message when they do not fit."""
    stored = {key: checkpoint.shape_and_dtype(key) for key in checkpoint.keys()}
    arrived, renamed = _match_with_prefixes(template, stored)
    shapes = {renamed[key]: shape for key, shape in stored.items()}
    fills: list[tuple[str, str]] = []
    missing: list[str] = []
    reshaped: dict[str, tuple[torch.Size, torch.Size]] = {}
    tensors = dict(model_keys(model))
    groups = tensor_groups(model)
    for names in groups.values():
        found = next((name for name in names if name in arrived), None)
        if found is None:
            missing.append(names[0])
            continue
        expected, got = tensors[found].shape, shapes[arrived[found]][0]
        if tuple(expected) != tuple(got):
            reshaped[arrived[found]] = (got, expected)
        fills.append((found, arrived[found]))
    used = set(arrived.values())
    unexpected = [key for key in shapes if key not in used]
    # Keys the model says to leave aside, as from_pretrained does (GPT-2's old attn.bias masks).
    unexpected = [key for key in unexpected if not _ignored(template, "_keys_to_ignore_on_load_unexpected", key)]
    missing = [key for key in missing if not _ignored(template, "_keys_to_ignore_on_load_missing", key)]
    original = {new: old for old, new in renamed.items()}
    hint = "Check that build() makes the model the checkpoint was saved from" + (
        "; strict=False initializes what the checkpoint lacks (new LoRA weights) and leaves aside what the model lacks."
        if strict else "."
    )
    problem = describe_mismatch(f"The checkpoint {checkpoint.path}", missing if strict else [], unexpected if strict else [], reshaped, hint)
    if problem is None and not strict and 2 * len(fills) < len(groups):
        problem = (
            f"build_sharded(strict=False): the checkpoint {checkpoint.path} fills only {len(fills)} of the model's "
            f"{len(groups)} tensors, so the model would be mostly random. Likely cause: it is another model's "
            f"checkpoint, or its keys are named differently (the checkpoint has {', '.join(list(stored)[:3])}; "
            f"the model expects {', '.join(next(iter(g)) for g in list(groups.values())[:3])}). Check that build() makes "
            "the model the checkpoint was saved from; strict=False is for a few tensors, such as new LoRA weights."
        )
    return {"fills": [(name, original[key]) for name, key in fills], "missing": missing,
            "unexpected": [original[key] for key in unexpected], "problem": problem}


def _ignored(model: nn.Module, patterns: str, key: str) -> bool:
    return any(re.search(pattern, key) for pattern in getattr(model, patterns, None) or ())


_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP's and torch.compile's wrappers, in saved keys


def _without(prefix: str, key: str) -> str:
    return key.removeprefix(prefix)


def _match_with_prefixes(template: nn.Module, stored: dict[str, tuple[torch.Size, torch.dtype]]) -> tuple[dict[str, str], dict[str, str]]:
    """``match_keys`` with the checkpoint's keys as they are, or with the model's base prefix added
    or removed (as Hugging Face's ``from_pretrained`` does: GPT-2 ships without ``transformer.``),
    or a wrapper's prefix removed; whichever fills most. Returns (model key -> renamed key,
    stored key -> renamed key)."""
    prefix = getattr(template, "base_model_prefix", "")
    renamings: list[Callable[[str], str]] = [lambda key: key]
    if isinstance(prefix, str) and prefix:
        renamings += [lambda key: key if key.startswith(f"{prefix}.") else f"{prefix}.{key}",
                      lambda key: key.removeprefix(f"{prefix}.")]
    renamings += [functools.partial(_without, wrapper) for wrapper in _WRAPPER_PREFIXES]
    best: tuple[dict[str, str], dict[str, str]] = ({}, {key: key for key in stored})
    for rename in renamings:
        renamed = {key: rename(key) for key in stored}
        if len(set(renamed.values())) < len(renamed):  # two stored keys under one name: not this renaming
            continue
        arrived = match_keys(template, {renamed[key]: shape for key, shape in stored.items()})
        if len(arrived) > len(best[0]):
            best = (arrived, renamed)
        if len(arrived) == len(stored):
            break
    return best


def load_full_from_rank0(model: nn.Module, template: nn.Module, path: str, strict: bool) -> set[str]:
    """Fill each shard from the checkpoint that rank 0 alone reads, one tensor at a time; returns
    the keys of tensors it lacks (only with ``strict=False``)."""
    plan: list[dict[str, Any] | None] = [None]
    checkpoint = None  # rank 0's, opened once: for the plan, then the tensors
    if dist.get_rank() == 0:
        try:
            checkpoint = open_checkpoint(path)
            plan[0] = _plan_full_load(model, template, checkpoint, strict)
        except (OSError, ValueError, RuntimeError, ImportError) as error:
            plan[0] = {"problem": f"{type(error).__name__}: {error}"}
    dist.broadcast_object_list(plan, src=0)  # every rank raises together, none waits forever
    assert plan[0] is not None
    if plan[0]["problem"]:
        raise ValueError(plan[0]["problem"])
    if plan[0]["unexpected"] and dist.get_rank() == 0:
        left = plan[0]["unexpected"]
        warnings.warn(f"build_sharded(strict=False): {len(left)} checkpoint keys the model lacks were left aside: "
                      f"{', '.join(left[:10])}{' ...' if len(left) > 10 else ''}", stacklevel=3)
    tensors = dict(model_keys(model))
    with torch.no_grad():
        for name, key in plan[0]["fills"]:
            # Converted to the model's dtype a piece at a time; other ranks only receive.
            scatter_into(tensors[name], checkpoint.tensor(key) if checkpoint is not None else None)
    return set(plan[0]["missing"])
