"""Per-rank peak memory of one training step of a Llama-shaped model sharded on 2 ranks.

The model has an untied embedding and head as large as a few of its layers (vocabulary
32,000), as Llama-style models do. It is built with nbshard.fsdp.build_sharded twice: with
the layers alone as sharding units (the embedding and head then live in the root unit,
gathered whole through forward and backward); with the embedding and the head as units of
their own, gathered whole around their use (``gather_in_chunks=False``); and with the
defaults (the embedding and the head gathered a chunk of rows at a time). Each figure is the rank's peak anonymous resident memory
(RssAnon, sampled every 2 ms) during one forward, backward and SGD step, above its memory
after building, as a fraction of the full model; the sharded state itself (parameters and
gradients) is 2 x 0.5 of the model on each of 2 ranks.

Usage: python benchmarks/train_step_memory.py [width] [depth]   (default 1024 8)
"""

from __future__ import annotations

import statistics
import sys

import nbshard

VOCABULARY = 32_000


def build_model(width: int, depth: int):
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(width)
            self.up = torch.nn.Linear(width, 4 * width)
            self.down = torch.nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x))))

    class LlamaShaped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCABULARY, width)
            self.layers = torch.nn.ModuleList(Block() for _ in range(depth))
            self.norm = torch.nn.LayerNorm(width)
            self.head = torch.nn.Linear(width, VOCABULARY, bias=False)

        def forward(self, tokens):
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    return LlamaShaped()


def measure(units: str, width: int, depth: int) -> dict:
    import torch
    from peak_memory import PeakAnonymousMemory

    from nbshard import fsdp

    nbshard.init_process_group()
    blocks = (lambda model: list(model.layers)) if units == "layers only" else fsdp.default_blocks
    model = fsdp.build_sharded(lambda: build_model(width, depth), blocks=blocks, gather_in_chunks=units == "default")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, VOCABULARY, (2, 64), generator=torch.Generator().manual_seed(0))
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    peaks = []
    for _ in range(3):
        with PeakAnonymousMemory() as peak:
            loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)  # the gradients stay allocated, as between real steps
        peaks.append(peak.above_baseline)
    return {"peak_above_built": statistics.median(peaks), "model_bytes": full_bytes}


def main(width: int = 1024, depth: int = 8) -> None:
    params = sum(p.numel() for p in build_model(width, depth).parameters())
    print(f"model: {params / 1e6:.0f}M parameters ({params * 4 / 2**30:.2f} GiB fp32), embedding and head "
          f"{2 * VOCABULARY * width / params:.0%} of it; 2 ranks; median of 3 steps")
    for units in ("layers only", "whole units", "default"):
        results = nbshard.run(measure, units, width, depth, nproc=2, return_all=True, show_ranks=[])
        print(f"  {units:12s} step peak above the built model: "
              + ", ".join(f"{r['peak_above_built'] / 2**30:.2f} GiB = {r['peak_above_built'] / r['model_bytes']:.2f}" for r in results)
              + " of the model", flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
