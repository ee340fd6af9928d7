"""``nbshard.fsdp``, the public name of ``nbshard.rank.fsdp``: ``build_sharded``, ``save_full``
and their helpers, called inside a rank (they import torch)."""

from nbshard.rank.fsdp import *  # noqa: F403 - the public name re-exports the whole module
from nbshard.rank.fsdp import __all__  # noqa: F401
