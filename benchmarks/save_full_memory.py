"""Rank 0's memory while ``fsdp.save_full`` writes one consolidated checkpoint, beside the usual way.

A Hugging Face Llama (vocabulary 32,000, width 1,024, 8 layers, tied embedding: 0.13B
parameters, fp32) built with ``build_sharded`` on 2 CPU ranks; each way writes the whole
model to a file, in a fresh job each time, the ways alternated round by round:

- usual: ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``, then rank 0's
  ``torch.save`` (what ``save_full`` did before);
- ``save_full`` to a ``.pt`` file and to a ``.safetensors`` file (written a tensor at a time).

Figures are rank 0's peak anonymous resident memory (sampled every 2 ms) above its memory
before the save (the heap trimmed first), and what is still resident above it after (glibc's
heap trimmed where the way does so), as fractions of the model; beside them, the rank's shard and the largest unit.
Target: the peak at most one unit above the shard the rank holds anyway.

Usage: python benchmarks/save_full_memory.py [ROUNDS]   (default 3)
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

import nbshard

WAYS = ["usual", "save_full .pt", "save_full .safetensors"]


def build():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def measure(folder: str, way: str) -> dict:
    """One way, in a fresh 2-rank job: build, then save once."""
    import torch
    import torch.distributed as dist
    from peak_memory import PeakAnonymousMemory, anonymous_bytes
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from nbshard import fsdp
    from nbshard.rank.host_memory import release_freed_memory

    nbshard.init_process_group()
    model = fsdp.build_sharded(build)
    unique = {id(p): p for p in model.parameters()}.values()
    model_bytes = sum(p.numel() * p.element_size() for p in unique)
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in unique)
    units = fsdp.default_blocks(model)  # the layers, and the (tied) embedding as a unit of its own
    unit_bytes = max(sum(p.numel() * p.element_size() for p in {id(p): p for m in (u if isinstance(u, list) else [u])
                                                                   for p in m.parameters()}.values()) for u in units)
    release_freed_memory()  # the save starts from a trimmed heap
    dist.barrier()
    with PeakAnonymousMemory() as peak:
        if way == "usual":
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if dist.get_rank() == 0:
                torch.save(state, f"{folder}/usual.pt")
            del state
            dist.barrier()
        else:
            fsdp.save_full(model, f"{folder}/model{way.split()[-1]}")
    after = anonymous_bytes() - peak.baseline
    return {"peak": peak.above_baseline / model_bytes, "after": after / model_bytes, "model": model_bytes,
            "shard": shard_bytes / model_bytes, "unit": unit_bytes / model_bytes, "rank": dist.get_rank()}


def main(rounds: int) -> None:
    results: dict[str, list[dict]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory(prefix="nbshard-bench-") as folder:
        for _ in range(rounds):
            for way in WAYS:  # alternated, each in a fresh job
                out = nbshard.run(measure, folder, way, nproc=2, return_all=True, show_ranks=[])
                results[way].append(next(r for r in out if r["rank"] == 0))
    first = results[WAYS[0]][0]
    print(f"Llama 0.13B (fp32, {first['model'] / 2**20:.0f} MiB), 2 CPU ranks, {rounds} rounds alternated, a fresh job each; "
          f"rank 0's shard {first['shard']:.2f} of the model, its largest unit {first['unit']:.3f}")
    print("  (rank 0's figures above its memory before the save, as fractions of the model; medians, then each round)")
    for way in WAYS:
        peaks = [r["peak"] for r in results[way]]
        after = statistics.median(r["after"] for r in results[way])
        print(f"  {way:24s} peak {statistics.median(peaks):.3f}  resident after {after:.3f}   "
              f"rounds: {', '.join(f'{p:.3f}' for p in peaks)}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
