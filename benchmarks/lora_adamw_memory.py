"""Per-rank peak memory of LoRA and full AdamW training steps of litgpt and Hugging Face Llama models sharded on 2 ranks.

litgpt's own ``GPT`` (LoRA variant) with Llama-3.2-1B's shape (vocabulary 128,256, width
2,048; litgpt keeps the head untied), built by nbshard.fsdp.build_sharded from scratch with
the defaults (the layers as FSDP2 units, the embedding and head gathered in chunks). Each figure is the rank's peak anonymous resident memory (RssAnon, sampled
every 2 ms) above its memory before building, during the third training step, as a fraction
of the full model (fp32):

- LoRA: the base frozen, LoRA weights (r=8 on query and value) trained with AdamW;
  target at most 0.75 (the shard is 0.5);
- full fine-tuning with AdamW: the sharded state (parameters, gradients, two moments) is
  2.0 of the model on each of 2 ranks; target within 0.25 of it (2.25).

Each is measured with build_sharded's default (on the CPU, glibc's heap is trimmed at each
sharding unit's boundaries: ``return_freed_memory``) and without it (what glibc keeps of
freed memory counts too); AdamW with torch's default (a for-loop over parameters on the
CPU, a temporary of each parameter's size) and with ``fused=True``.

The third mode is the same full fine-tuning step of Hugging Face's ``LlamaForCausalLM``
(tied embedding, as the real model).

Usage: python benchmarks/lora_adamw_memory.py [layers_lora] [layers_adamw] [layers_hf_adamw]
(default 8 8 12: about 1B parameters each; 0 skips a mode). Needs litgpt (pip install --no-deps litgpt) and transformers.
"""

from __future__ import annotations

import statistics
import sys

import nbshard


def measure(mode: str, layers: int, return_freed_memory: bool, fused: bool) -> dict:
    import torch
    from peak_memory import PeakAnonymousMemory, anonymous_bytes

    from nbshard import fsdp

    nbshard.init_process_group()
    build, vocabulary = _model(mode, layers)
    before_build = anonymous_bytes()
    with PeakAnonymousMemory() as building:
        model = fsdp.build_sharded(build, return_freed_memory=return_freed_memory)
    if mode == "lora":
        from litgpt.lora import mark_only_lora_as_trainable

        mark_only_lora_as_trainable(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=fused or None)
    tokens = torch.randint(0, vocabulary, (2, 64), generator=torch.Generator().manual_seed(0))
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    peaks = []
    for _ in range(3):
        with PeakAnonymousMemory() as peak:
            logits = model(tokens[:, :-1])
            logits = getattr(logits, "logits", logits)  # a Hugging Face model's output
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        peaks.append(peak.peak - before_build)
    return {"peak": peaks[-1], "median": statistics.median(peaks), "model_bytes": full_bytes,
            "build": building.peak - before_build}


def _model(mode: str, layers: int):
    """The model's builder and vocabulary: litgpt's LoRA GPT, or Hugging Face's Llama (tied, as the real one)."""
    if mode == "hf-adamw":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                             num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)
        return (lambda: LlamaForCausalLM(config)), config.vocab_size
    from litgpt.lora import GPT, Config

    config = Config.from_name("Llama-3.2-1B", n_layer=layers, block_size=128, lora_r=8, lora_alpha=16,
                              lora_query=mode == "lora", lora_value=mode == "lora")
    return (lambda: GPT(config)), config.padded_vocab_size


VARIANTS = {  # what each mode is measured with: freed memory returned at unit boundaries or not; AdamW's default or fused
    "lora": [("build_sharded default", True, False), ("return_freed_memory=False", False, False)],
    "adamw": [("AdamW(fused=True), build_sharded default", True, True),
              ("AdamW(fused=True), return_freed_memory=False", False, True),
              ("torch.optim.AdamW default (for-loop on CPU), build_sharded default", True, False)],
    "hf-adamw": [("Hugging Face LlamaForCausalLM, AdamW(fused=True), build_sharded default", True, True),
                 ("Hugging Face LlamaForCausalLM, AdamW(fused=True), return_freed_memory=False", False, True)],
}


def main(layers_lora: int = 8, layers_adamw: int = 8, layers_hf_adamw: int = 12) -> None:
    for mode, layers, target in (("lora", layers_lora, 0.75), ("adamw", layers_adamw, 2.25), ("hf-adamw", layers_hf_adamw, 2.25)):
        if not layers:  # 0 skips that mode
            continue
        for label, return_freed_memory, fused in VARIANTS[mode]:
            results = nbshard.run(measure, mode, layers, return_freed_memory, fused, nproc=2, return_all=True, show_ranks=[])
            size = results[0]["model_bytes"]
            print(f"{mode}: Llama-3.2-1B shape with {layers} layers, {size / 4 / 1e9:.2f}B parameters "
                  f"({size / 2**30:.2f} GiB fp32), {label}")
            print("  building (from scratch): "
                  + ", ".join(f"{r['build'] / 2**30:.2f} GiB = {r['build'] / r['model_bytes']:.2f}" for r in results))
            print("  third step's peak above the rank's memory before building: "
                  + ", ".join(f"{r['peak'] / 2**30:.2f} GiB = {r['peak'] / r['model_bytes']:.2f}" for r in results)
                  + f" of the model (target at most {target})", flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
