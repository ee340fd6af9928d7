"""Models for the sharded-loading tests; ranks import this module by name."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class RotaryLM(nn.Module):
    """Tied embedding and head, and a non-persistent rotary buffer, like many LLMs."""

    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 3, tie: bool = True, head_bias: bool = False,
                 padding_idx: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=padding_idx)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=head_bias)
        if tie:
            self.head.weight = self.embed.weight  # tied after the layers are built
        inv_freq = 1.0 / (10000 ** (torch.arange(0, width, 2).float() / width))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        angles = torch.arange(tokens.shape[-1], device=tokens.device).float()[:, None] * self.inv_freq[None, :]
        x = x + torch.cat([angles.sin(), angles.cos()], dim=-1)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.blocks = nn.ModuleList([nn.Linear(4, 4)])


TOKENS = torch.arange(16).reshape(2, 8) % 64


def from_scratch(seed):
    import torch.distributed as dist

    import nbshard
    from nbshard import fsdp

    nbshard.init_process_group()
    model = fsdp.build_sharded(RotaryLM, seed=seed)
    local = model.blocks[0].up.weight.to_local()
    shards = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, local.contiguous())
    logits = model(TOKENS.to(nbshard.device()))
    return {
        "state": fsdp.full_state_dict(model),
        "inv_freq": model.inv_freq.clone(),
        "tied": model.head.weight is model.embed.weight,
        "shards_differ": len(shards) > 1 and not torch.equal(shards[0], shards[1]),
        "logits": logits.detach().full_tensor() if hasattr(logits, "full_tensor") else logits.detach(),
    }


def from_full_checkpoint(path):
    import nbshard
    from nbshard import fsdp

    nbshard.init_process_group()
    model = fsdp.build_sharded(RotaryLM, full_checkpoint=path)
    logits = model(TOKENS.to(nbshard.device()))
    return {"state": fsdp.full_state_dict(model), "logits": logits.detach(), "tied": model.head.weight is model.embed.weight}


def train_and_save(folder, full_path):
    import nbshard
    from nbshard import fsdp

    nbshard.init_process_group()
    model = fsdp.build_sharded(RotaryLM, seed=5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(TOKENS.to(nbshard.device())).pow(2).mean().backward()
    optimizer.step()
    fsdp.save_sharded(model, folder)
    fsdp.save_full(model, full_path)
    return fsdp.full_state_dict(model)


def from_sharded_checkpoint(folder, **build_options):
    import nbshard
    from nbshard import fsdp

    nbshard.init_process_group()
    model = fsdp.build_sharded(lambda: RotaryLM(**build_options), sharded_checkpoint=folder)
    return fsdp.full_state_dict(model)


def without_reset_parameters():
    import nbshard
    from nbshard import fsdp

    nbshard.init_process_group()
    fsdp.build_sharded(NoInit)


class LoRALinear(nn.Module):
    """Like litgpt's: the base layer moves under ``.linear``, and base checkpoints still load
    because the module renames their keys in its own ``_load_from_state_dict``."""

    def __init__(self, width: int, out: int, rank: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(width, out, bias=False)
        self.lora_A = nn.Parameter(torch.empty(rank, width))
        self.lora_B = nn.Parameter(torch.empty(out, rank))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A, a=5**0.5)
        nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + x @ self.lora_A.T @ self.lora_B.T

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        for name in ("weight", "bias"):
            if prefix + name in state_dict and prefix + "linear." + name not in state_dict:
                state_dict[prefix + "linear." + name] = state_dict.pop(prefix + name)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class LoRALM(RotaryLM):
    """RotaryLM with a LoRA head (untied): base checkpoints name it ``head.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.head = LoRALinear(32, 64)


def lora_from_base_checkpoint(path, strict):
    import nbshard
    from nbshard import fsdp

    nbshard.init_process_group()
    model = fsdp.build_sharded(LoRALM, full_checkpoint=path, strict=strict)
    return fsdp.full_state_dict(model)


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{
        "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True, **overrides,
    })


def hugging_face_llama(checkpoint=None, **overrides):
    """A Llama from its config, sharded: from a checkpoint, or from scratch with its own init."""
    from transformers import LlamaForCausalLM

    import nbshard
    from nbshard import fsdp

    nbshard.init_process_group()
    config = tiny_llama_config(**overrides)
    model = fsdp.build_sharded(lambda: LlamaForCausalLM(config), full_checkpoint=checkpoint)
    tokens = torch.arange(16).reshape(2, 8)
    logits = model(input_ids=tokens).logits.detach()
    return {
        "state": fsdp.full_state_dict(model), "logits": logits.full_tensor() if hasattr(logits, "full_tensor") else logits,
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }


def plain_base() -> RotaryLM:
    """The base model of LoRALM: RotaryLM with an untied plain head."""
    model = RotaryLM()
    model.head = nn.Linear(32, 64, bias=False)
    return model


def lora_train_and_save(base_path, folder):
    """Fine-tune only the LoRA weights, then save them alone, and the whole model under the base's keys."""
    import nbshard
    from nbshard import fsdp

    nbshard.init_process_group()
    model = fsdp.build_sharded(LoRALM, full_checkpoint=base_path, strict=False)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(TOKENS.to(nbshard.device())).pow(2).mean().backward()
    optimizer.step()
    with torch.device("meta"):
        base = plain_base()
    fsdp.save_full(model, f"{folder}/lora.pt", trainable_only=True)
    fsdp.save_full(model, f"{folder}/as_base.safetensors", keys_of=base)
    return fsdp.full_state_dict(model)


class WithCounter(RotaryLM):
    """A persistent buffer that older checkpoints lack."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.register_buffer("counter", torch.tensor(7.0))


def with_counter_from(path):
    import nbshard
    from nbshard import fsdp

    nbshard.init_process_group()
    return fsdp.full_state_dict(fsdp.build_sharded(WithCounter, full_checkpoint=path, strict=False))


def rank_batches(vocab: int) -> list[torch.Tensor]:
    """Each rank's own batch, of its own shape (data parallel, as a DataLoader with dynamic padding gives)."""
    generator = torch.Generator().manual_seed(vocab)
    return [torch.randint(0, vocab, (2, 8), generator=generator), torch.randint(0, vocab, (3, 5), generator=generator)]


def large_vocabulary(vocab, tied, chunks, **options):
    """Embedding and head large beside a layer: their own sharding units, or gathered in chunks; each
    rank its own batch, one SGD step."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    import nbshard
    from nbshard import fsdp

    nbshard.init_process_group()

    model = fsdp.build_sharded(lambda: RotaryLM(vocab=vocab, tie=tied, **options), seed=3, gather_in_chunks=chunks)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logits = model(rank_batches(vocab)[dist.get_rank()].to(nbshard.device()))
    logits.pow(2).mean().backward()
    optimizer.step()
    return {
        "units": sorted(name for name, module in model.named_modules() if isinstance(module, FSDPModule) and name),
        "chunked": sorted(name for name, module in model.named_modules() if hasattr(module, "_nbshard_rows")),
        "state": fsdp.full_state_dict(model), "tied": model.head.weight is model.embed.weight,
        "logits": logits.detach().cpu(),
    }


def large_vocabulary_round_trip(folder, full_path):
    """A model whose embedding and head are gathered in chunks, trained a step, saved sharded and
    full, and built again from each: the states it returns must all be equal."""
    import torch.distributed as dist

    import nbshard
    from nbshard import fsdp

    nbshard.init_process_group()
    build = lambda: RotaryLM(vocab=1001, tie=False, head_bias=True)  # noqa: E731
    model = fsdp.build_sharded(build, seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(rank_batches(1001)[dist.get_rank()]).pow(2).mean().backward()
    optimizer.step()
    fsdp.save_sharded(model, folder)
    fsdp.save_full(model, full_path)
    states = {"trained": fsdp.full_state_dict(model)}
    states["from sharded"] = fsdp.full_state_dict(fsdp.build_sharded(build, sharded_checkpoint=folder))
    states["from full"] = fsdp.full_state_dict(fsdp.build_sharded(build, full_checkpoint=full_path))
    return {"states": states, "chunked": sorted(n for n, m in model.named_modules() if hasattr(m, "_nbshard_rows"))}


def embedding_out_of_range():
    import nbshard
    from nbshard import fsdp

    nbshard.init_process_group()
    model = fsdp.build_sharded(lambda: RotaryLM(vocab=1001), seed=0)
    model(torch.tensor([[3, 1001]]))


LITGPT_MODEL = {"name": "pythia-14m", "n_layer": 2, "block_size": 64}
LITGPT_LORA = {"lora_r": 4, "lora_alpha": 8, "lora_query": True, "lora_value": True}
LITGPT_TOKENS = torch.arange(32).reshape(2, 16)


def litgpt_config(lora: bool):
    from litgpt.config import Config

    name, overrides = LITGPT_MODEL["name"], {k: v for k, v in LITGPT_MODEL.items() if k != "name"}
    if lora:
        from litgpt.lora import Config as LoRAConfig

        return LoRAConfig.from_name(name, **overrides, **LITGPT_LORA)
    return Config.from_name(name, **overrides)


def litgpt_lora_from_base(path):
    """litgpt's own LoRA GPT, sharded, from a base checkpoint in one call."""
    from litgpt.lora import GPT, mark_only_lora_as_trainable

    import nbshard
    from nbshard import fsdp

    nbshard.init_process_group()
    model = fsdp.build_sharded(lambda: GPT(litgpt_config(lora=True)), full_checkpoint=path, strict=False)
    mark_only_lora_as_trainable(model)
    logits = model(LITGPT_TOKENS.to(nbshard.device())).detach()
    return {
        "state": fsdp.full_state_dict(model), "logits": logits.full_tensor() if hasattr(logits, "full_tensor") else logits,
        "trainable": fsdp.full_state_dict(model, trainable_only=True),
    }


class InPlaceLM(RotaryLM):
    """Adds to each block's output in place, as many models do with residuals."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
            x += 1.0
        return self.head(self.norm(x))


def step_returning_freed_memory(return_freed_memory):
    """One SGD step of a CPU model built with return_freed_memory on, off or by default."""
    import torch.distributed as dist

    import nbshard
    from nbshard import fsdp

    nbshard.init_process_group()
    model = fsdp.build_sharded(lambda: InPlaceLM(vocab=512), seed=3, return_freed_memory=return_freed_memory)
    def hooked(hooks: str, name: str) -> list[str]:
        return sorted(path for path, module in model.named_modules()
                      if any(getattr(hook, "__name__", "") == name for hook in getattr(module, hooks).values()))

    trimmed = {"forward": hooked("_forward_pre_hooks", "before_forward"), "backward": hooked("_forward_hooks", "after_forward")}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logits = model(rank_batches(512)[dist.get_rank()])
    logits.pow(2).mean().backward()
    optimizer.step()
    return {"trimmed": trimmed, "state": fsdp.full_state_dict(model)}


def tiny_gpt2_config(**overrides):
    from transformers import GPT2Config

    return GPT2Config(**{"vocab_size": 128, "n_positions": 32, "n_embd": 64, "n_layer": 4, "n_head": 4,
                         "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **overrides})  # no dropout: steps compare


def hugging_face_gpt2(checkpoint=None, strict=True, **overrides):
    """A GPT-2 from its config, sharded: from a checkpoint, or from scratch with its own init."""
    from transformers import GPT2LMHeadModel

    import nbshard
    from nbshard import fsdp

    nbshard.init_process_group()
    model = fsdp.build_sharded(lambda: GPT2LMHeadModel(tiny_gpt2_config(**overrides)), full_checkpoint=checkpoint, strict=strict)
    logits = model(input_ids=torch.arange(16).reshape(2, 8)).logits.detach()
    return {"state": fsdp.full_state_dict(model), "logits": logits.full_tensor() if hasattr(logits, "full_tensor") else logits}


def plain_model(kind: str):
    """A small real model of each kind, unsharded (built on meta inside build_sharded)."""
    if kind == "gpt2":
        from transformers import GPT2LMHeadModel

        return GPT2LMHeadModel(tiny_gpt2_config())
    if kind == "llama":
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(tiny_llama_config())
    from litgpt.lora import GPT

    return GPT(litgpt_config(lora=True))


def logits_of(model, tokens):
    out = model(input_ids=tokens) if hasattr(model, "config") and hasattr(model.config, "model_type") else model(tokens)
    return getattr(out, "logits", out)


def one_step(model, tokens):
    """What a training step is here: the same in a rank and in one process."""
    loss = logits_of(model, tokens).float().pow(2).mean()
    loss.backward()


def train_after_eval(kind: str):
    """Check the loaded model under no_grad first (as people do), then train one step; a model
    sharded by build_sharded must train every parameter as one process would."""
    import torch.distributed as dist

    import nbshard
    from nbshard import fsdp

    nbshard.init_process_group()
    model = fsdp.build_sharded(lambda: plain_model(kind))
    before = fsdp.full_state_dict(model)
    tokens = torch.arange(32).reshape(2, 16) % 100
    with torch.no_grad():
        logits_of(model, tokens)  # an eval forward: FSDP2 leaves a root unsharded after it
    if kind == "litgpt_lora":
        from litgpt.lora import mark_only_lora_as_trainable

        mark_only_lora_as_trainable(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    one_step(model, tokens)
    optimizer.step()
    after = fsdp.full_state_dict(model)
    trainable = fsdp.full_state_dict(model, trainable_only=True)
    if dist.get_rank() == 0:
        return {"before": before, "after": after, "trainable": sorted(trainable), "tokens": tokens}


def save_full_both_formats(folder, dtype_name):
    """A tied model in ``dtype``, with a counter buffer, saved whole in both formats."""
    import nbshard
    from nbshard import fsdp

    nbshard.init_process_group()
    dtype = getattr(torch, dtype_name)
    model = fsdp.build_sharded(lambda: WithCounter(vocab=1001).to(dtype), seed=4)  # 1001 rows: uneven shards
    fsdp.save_full(model, f"{folder}/model.pt")
    fsdp.save_full(model, f"{folder}/model.safetensors")
    return fsdp.full_state_dict(model)


def litgpt_merge_in_ranks():
    """litgpt's LoRA GPT, sharded, with non-zero LoRA weights, merged in the ranks."""
    from litgpt.lora import GPT

    import nbshard
    from nbshard import fsdp

    nbshard.init_process_group()
    model = fsdp.build_sharded(lambda: GPT(litgpt_config(lora=True)))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.to_local().normal_(std=0.05)  # B starts at zero: give the update something to add
    tokens = LITGPT_TOKENS.to(nbshard.device())
    before, logits = fsdp.full_state_dict(model), model(tokens).detach()
    merged = fsdp.merge_lora(model)
    after = model(tokens).detach()  # merged: the LoRA path is skipped, the base weight carries it
    return {"before": before, "after": fsdp.full_state_dict(model), "merged": merged,
            "logits": [x.full_tensor() if hasattr(x, "full_tensor") else x for x in (logits, after)]}
