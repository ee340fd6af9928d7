"""Rank 0's memory while ``fsdp.save_full`` writes one consolidated checkpoint, beside the usual way.

A Hugging Face Llama (vocabulary 32,000, width 1,024, 8 layers, tied embedding: 0.13B
parameters, fp32) built with ``build_sharded`` on 2 CPU ranks; in one job, alternating,
each way writes the whole model to a file:

- usual: ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``, then rank 0's
  ``torch.save`` (what ``save_full`` did before);
- ``save_full`` to a ``.pt`` file and to a ``.safetensors`` file (written a tensor at a time).

Figures are rank 0's peak anonymous resident memory (sampled every 2 ms) above its memory
before the save, and what is still resident above it after (glibc's heap trimmed where the
way does so), as fractions of the model; beside them, the rank's shard and the largest unit.
Target: the peak at most the shard plus one unit.

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


def measure(folder: str, rounds: int) -> dict:
    import torch
    import torch.distributed as dist
    from peak_memory import PeakAnonymousMemory, anonymous_bytes
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from nbshard import fsdp

    nbshard.init_process_group()
    model = fsdp.build_sharded(build)
    unique = {id(p): p for p in model.parameters()}.values()
    model_bytes = sum(p.numel() * p.element_size() for p in unique)
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in unique)
    unit_bytes = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.model.layers)
    results: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    for _ in range(rounds):
        for way in WAYS:
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
            results[way].append((peak.above_baseline / model_bytes, after / model_bytes))
    return {"results": results, "model": model_bytes, "shard": shard_bytes, "unit": unit_bytes, "rank": dist.get_rank()}


def main(rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="nbshard-bench-") as folder:
        out = nbshard.run(measure, folder, rounds, nproc=2, return_all=True, show_ranks=[])
    rank0 = next(r for r in out if r["rank"] == 0)
    model, shard, unit = rank0["model"], rank0["shard"], rank0["unit"]
    print(f"Llama 0.13B (fp32, {model / 2**20:.0f} MiB), 2 CPU ranks, {rounds} rounds alternated; rank 0's shard "
          f"{shard / model:.2f} of the model, its largest unit {unit / model:.3f}; target: peak <= {(shard + unit) / model:.2f}")
    print("  (figures above rank 0's memory before the save, as fractions of the model; medians, then each round)")
    for way in WAYS:
        peaks, afters = zip(*rank0["results"][way])
        print(f"  {way:24s} peak {statistics.median(peaks):.3f}  resident after {statistics.median(afters):.3f}   "
              f"rounds: {', '.join(f'{p:.3f}' for p in peaks)}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
