"""Training-step time and peak memory of ``build_sharded`` against plain FSDP2, side by side.

A Hugging Face Llama of 106M parameters (vocabulary 32,000, width 768, 8 layers: its untied
embedding and head are 46% of it), on 2 CPU ranks (gloo), one AdamW step at a time on a
batch of 2 x 256 tokens per rank. Two ways, a fresh 2-rank job each, alternating, each round:

- plain FSDP2: the model built whole on each rank, ``fully_shard`` on each decoder layer,
  then on the root (the usual recipe);
- ``nbshard.fsdp.build_sharded`` with its defaults (layers as units; the embedding and head
  row-sharded and computed a chunk at a time).

Prints each round's median step time of each way (``STEPS`` steps after ``WARMUP``), the
paired ratio per round and its median, and each way's peak anonymous memory during the
steps above its memory once built.

Usage: python benchmarks/step_time.py [rounds] [option=value ...]   (options go to build_sharded)
"""

from __future__ import annotations

import statistics
import sys
import time

import nbshard

WARMUP, STEPS = 2, 6


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                         num_attention_heads=12, num_key_value_heads=12, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def steps(way: str, options: dict) -> dict:
    import torch
    from peak_memory import PeakAnonymousMemory
    from torch.distributed.fsdp import fully_shard

    from nbshard import fsdp

    nbshard.init_process_group()
    torch.manual_seed(0)
    if way == "plain FSDP2":
        model = llama()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        model = fsdp.build_sharded(llama, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 32000, (2, 256), generator=torch.Generator().manual_seed(1 + torch.distributed.get_rank()))
    times = []
    with PeakAnonymousMemory() as peak:
        for step in range(WARMUP + STEPS):
            started = time.perf_counter()
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step >= WARMUP:
                times.append(time.perf_counter() - started)
    return {"step": statistics.median(times), "peak": peak.above_baseline}


def main(rounds: int = 3, **options: object) -> None:
    ways = ("plain FSDP2", "build_sharded")
    results: dict[str, list[dict]] = {way: [] for way in ways}
    print(f"2 CPU ranks, Llama 106M, batch 2 x 256 per rank, AdamW; build_sharded options {options or 'defaults'}; "
          f"median of {STEPS} steps per job")
    for round_ in range(rounds):
        for way in (ways if round_ % 2 == 0 else ways[::-1]):
            ranks = nbshard.run(steps, way, options, nproc=2, return_all=True, show_ranks=[], sample_interval=None)
            results[way].append({"step": max(r["step"] for r in ranks), "peak": max(r["peak"] for r in ranks)})
        plain, ours = (results[way][-1] for way in ways)
        print(f"  round {round_ + 1}: plain FSDP2 {plain['step'] * 1000:.0f} ms, build_sharded {ours['step'] * 1000:.0f} ms, "
              f"ratio {ours['step'] / plain['step']:.3f}", flush=True)
    ratios = [o["step"] / p["step"] for p, o in zip(*(results[way] for way in ways))]
    for way in ways:
        print(f"{way:14s} step median {statistics.median(r['step'] for r in results[way]) * 1000:.0f} ms, "
              f"peak above built {statistics.median(r['peak'] for r in results[way]) / 2**20:.0f} MiB")
    print(f"build_sharded / plain FSDP2: median paired ratio {statistics.median(ratios):.3f} "
          f"(rounds {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    options = dict(arg.split("=", 1) for arg in sys.argv[2:])
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3,
         **{k: (v == "True" if v in ("True", "False") else v) for k, v in options.items()})
