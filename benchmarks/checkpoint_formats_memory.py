"""Per-rank peak memory of loading a ~1B language model on 2 ranks, from each checkpoint format.

Two real model classes with Llama-3.2-1B's shape (vocabulary 128,256, width 2,048):
litgpt's ``GPT`` (untied head; 8 layers: 1.01B parameters) and Hugging Face's
``LlamaForCausalLM`` (tied embedding; 16 layers: 1.24B, the real model's size), fp32.
Ways to load, each a fresh 2-rank job:

- naive: the full model from ``torch.load`` on every rank, then ``fully_shard``;
- Fabric: ``ModelParallelStrategy`` with ``fabric.init_module(empty_init=True)``,
  ``fabric.setup`` and ``fabric.load_raw`` of the full checkpoint (Lightning's way);
- ``fsdp.build_sharded`` from scratch, from a ``torch.save`` file, a single
  ``.safetensors`` file, a sharded safetensors directory with its index, and a
  ``torch.distributed.checkpoint`` directory.

Each figure is the rank's peak anonymous resident memory (RssAnon, sampled every 2 ms;
the page cache of a memory-mapped file is not counted) above its memory before loading,
as a fraction of the full model. Target: at most 0.6 (the shard is 0.5).

Usage: python benchmarks/checkpoint_formats_memory.py [litgpt|llama ...]   (default both)
Needs litgpt (pip install --no-deps litgpt), transformers and safetensors.
"""

from __future__ import annotations

import os
import sys
import tempfile

import nbshard

LAYERS = {"litgpt": 8, "llama": 16}


def build(kind: str):
    if kind == "litgpt":
        from litgpt.model import GPT, Config

        return GPT(Config.from_name("Llama-3.2-1B", n_layer=LAYERS[kind], block_size=128))
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=LAYERS[kind],
                         num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def write_checkpoints(kind: str, folder: str) -> int:
    """The formats people download, from one model: .pt, .safetensors, sharded safetensors with an index."""
    import torch
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = build(kind)
    state = model.state_dict()
    if kind == "llama":
        state = {key: value for key, value in state.items() if key != "lm_head.weight"}  # tied: HF omits it
    torch.save(state, f"{folder}/full.pt")
    save_file({key: value.contiguous() for key, value in state.items()}, f"{folder}/model.safetensors")
    os.makedirs(f"{folder}/sharded-safetensors")
    save_torch_state_dict(state, f"{folder}/sharded-safetensors", max_shard_size="1GB")
    return sum(p.numel() for p in model.parameters())


def measure(kind: str, how: str, folder: str) -> dict:
    import torch
    from peak_memory import PeakAnonymousMemory
    from torch.distributed.fsdp import fully_shard

    from nbshard import fsdp

    nbshard.init_process_group()
    make = lambda: build(kind)  # noqa: E731
    with PeakAnonymousMemory() as peak:
        if how == "naive":
            model = make()
            model.load_state_dict(torch.load(f"{folder}/full.pt", weights_only=True), strict=False)
            for unit in fsdp.default_blocks(model):
                fully_shard(unit)
            fully_shard(model)
        elif how == "Fabric empty_init":
            import lightning as L
            from lightning.fabric.strategies import ModelParallelStrategy

            def parallelize(model, mesh):
                for unit in fsdp.default_blocks(model):
                    fully_shard(unit, mesh=mesh["data_parallel"])
                fully_shard(model, mesh=mesh["data_parallel"])
                return model

            fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(parallelize))
            fabric.launch()  # under torchrun's environment: joins the running ranks
            with fabric.init_module(empty_init=True):
                model = make()
            model = fabric.setup(model)
            fabric.load_raw(f"{folder}/full.pt", model, strict=False)
        elif how == "from scratch":
            model = fsdp.build_sharded(make)
        elif how == "DCP directory":
            model = fsdp.build_sharded(make, sharded_checkpoint=f"{folder}/dcp")
        else:
            path = {"torch.save file": "full.pt", "safetensors file": "model.safetensors",
                    "sharded safetensors + index": "sharded-safetensors"}[how]
            model = fsdp.build_sharded(make, full_checkpoint=f"{folder}/{path}")
    if how == "from scratch":
        fsdp.save_sharded(model, f"{folder}/dcp")
    full_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    return {"peak": peak.above_baseline, "model_bytes": full_bytes}


WAYS = ["naive", "Fabric empty_init", "from scratch", "torch.save file", "safetensors file",
        "sharded safetensors + index", "DCP directory"]


def main(kinds: list[str]) -> None:
    for kind in kinds:
        with tempfile.TemporaryDirectory(prefix="nbshard-bench-") as folder:
            params = nbshard.run(write_checkpoints, kind, folder, nproc=1, show_ranks=[])
            print(f"{kind}: Llama-3.2-1B shape, {LAYERS[kind]} layers, {params / 1e9:.2f}B parameters "
                  f"({params * 4 / 2**30:.2f} GiB fp32), 2 ranks; peak per rank above its memory before loading")
            for how in WAYS:
                results = nbshard.run(measure, kind, how, folder, nproc=2, return_all=True, show_ranks=[])
                print(f"  {how:30s} " + ", ".join(
                    f"{r['peak'] / 2**30:.2f} GiB = {r['peak'] / r['model_bytes']:.2f}" for r in results), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["litgpt", "llama"])
