"""build_sharded loads the checkpoints people have: renamed keys, strict=False, tied weights,
safetensors (single and sharded with an index), Hugging Face directories, DCP directories."""

from __future__ import annotations

import math

import pytest
import torch

import nbshard
import sharded_models
from sharded_models import LoRALM, RotaryLM

pytestmark = pytest.mark.timeout(180)


def test_a_lora_model_loads_a_base_checkpoint_through_its_own_key_renames(tmp_path):
    torch.manual_seed(3)
    base = sharded_models.plain_base()
    path = tmp_path / "base.pt"
    torch.save(base.state_dict(), path)
    with pytest.raises(nbshard.JobFailed) as strict:
        nbshard.run(sharded_models.lora_from_base_checkpoint, str(path), True, nproc=2)
    message = str(strict.value.__cause__)
    assert "Missing from it: head.lora_A, head.lora_B" in message and "strict=False" in message
    assert "Not in the model" not in message  # head.weight arrived as head.linear.weight
    state = nbshard.run(sharded_models.lora_from_base_checkpoint, str(path), False, nproc=2)
    assert torch.equal(state["head.linear.weight"], base.head.weight.detach())
    assert torch.equal(state["embed.weight"], base.embed.weight.detach())
    assert torch.equal(state["head.lora_B"], torch.zeros(64, 4))  # initialized as LoRALinear does
    assert state["head.lora_A"].abs().sum() > 0
    plain = LoRALM()
    plain.load_state_dict(state)  # and it loads back into the LoRA class, strictly


def hugging_face_reference(**overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(sharded_models.tiny_llama_config(**overrides)).eval()


@pytest.mark.parametrize("layout", ["sharded safetensors", "one safetensors file", "pytorch_model.bin"])
def test_a_hugging_face_checkpoint_with_tied_embeddings_loads_in_one_call(tmp_path, layout):
    model = hugging_face_reference()
    if layout == "pytorch_model.bin":
        torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
        checkpoint = tmp_path
    else:
        model.save_pretrained(tmp_path, max_shard_size="20KB" if layout.startswith("sharded") else "1GB")
        names = sorted(p.name for p in tmp_path.iterdir())
        assert ("model.safetensors.index.json" in names) == layout.startswith("sharded"), names
        checkpoint = tmp_path if layout.startswith("sharded") else tmp_path / "model.safetensors"
    result = nbshard.run(sharded_models.hugging_face_llama, str(checkpoint), nproc=2)
    expected = model.state_dict()
    for key, value in expected.items():
        assert torch.equal(result["state"][key], value), key
    assert result["tied"]
    logits = model(input_ids=torch.arange(16).reshape(2, 8)).logits.detach()
    assert torch.allclose(result["logits"], logits, atol=1e-5)


def test_a_hugging_face_model_from_scratch_uses_its_own_initialization():
    result = nbshard.run(sharded_models.hugging_face_llama, nproc=2)
    state = result["state"]
    assert result["tied"] and torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    assert torch.equal(state["model.norm.weight"], torch.ones(32))  # RMSNorm: ones, from _init_weights
    weight = state["model.layers.0.mlp.up_proj.weight"]
    assert abs(weight.std().item() - 0.02) < 0.005  # normal(0, initializer_range), not kaiming's
    assert torch.isfinite(result["logits"]).all()


def test_a_dcp_directory_passed_as_the_full_checkpoint_is_read_sharded(tmp_path):
    folder = tmp_path / "sharded"
    trained = nbshard.run(sharded_models.train_and_save, str(folder), str(tmp_path / "full.pt"), nproc=2)
    state = nbshard.run(sharded_models.from_full_checkpoint, str(folder), nproc=2)["state"]
    for key, value in trained.items():
        assert torch.equal(state[key], value), key


def test_the_mapped_reader_reads_what_torchs_reader_reads(tmp_path):
    import torch.distributed.checkpoint as dcp

    from nbshard.rank.checkpoints import MappedReader

    saved = {"rows": torch.randn(300, 7), "odd": torch.arange(30.0).reshape(5, 6)[:, 1:], "half": torch.randn(9).half()}
    dcp.save({**saved, "step": 7}, checkpoint_id=str(tmp_path), no_dist=True)  # items at unaligned offsets
    mine = {**{key: torch.zeros_like(value) for key, value in saved.items()}, "step": 0}
    dcp.load(mine, storage_reader=MappedReader(str(tmp_path)), no_dist=True)
    for key, value in saved.items():
        assert torch.equal(mine[key], value), key
    assert mine["step"] == 7  # not a tensor: read by torch's own reader


def test_a_dcp_directory_saved_whole_or_by_another_number_of_ranks_loads_sharded(tmp_path):
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(5)
    model = RotaryLM()
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "whole"), no_dist=True)  # each tensor stored whole
    state = nbshard.run(sharded_models.from_sharded_checkpoint, str(tmp_path / "whole"), nproc=2)
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key
    trained = nbshard.run(sharded_models.train_and_save, str(tmp_path / "two"), str(tmp_path / "full.pt"), nproc=2)
    state = nbshard.run(sharded_models.from_sharded_checkpoint, str(tmp_path / "two"), nproc=3)
    for key, value in trained.items():
        assert torch.equal(state[key], value), key


def test_a_wrapped_state_dict_and_a_directory_without_a_checkpoint(tmp_path):
    model = RotaryLM()
    torch.save({"state_dict": model.state_dict()}, tmp_path / "wrapped.ckpt")
    state = nbshard.run(sharded_models.from_full_checkpoint, str(tmp_path / "wrapped.ckpt"), nproc=2)["state"]
    assert torch.equal(state["norm.weight"], model.norm.weight.detach())
    (tmp_path / "empty").mkdir()
    with pytest.raises(nbshard.JobFailed) as caught:
        nbshard.run(sharded_models.from_full_checkpoint, str(tmp_path / "empty"), nproc=2)
    assert "expected one of model.safetensors.index.json" in str(caught.value.__cause__)


def test_trainable_weights_alone_and_a_save_under_the_base_models_keys(tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(4)
    base = sharded_models.plain_base()
    torch.save(base.state_dict(), tmp_path / "base.pt")
    trained = nbshard.run(sharded_models.lora_train_and_save, str(tmp_path / "base.pt"), str(tmp_path), nproc=2)
    lora = torch.load(tmp_path / "lora.pt", weights_only=True)
    assert sorted(lora) == ["head.lora_A", "head.lora_B"]
    assert torch.equal(lora["head.lora_B"], trained["head.lora_B"]) and lora["head.lora_B"].abs().sum() > 0
    plain = sharded_models.plain_base()
    plain.load_state_dict(load_file(tmp_path / "as_base.safetensors"))  # strict: the base model's keys, all of them
    assert torch.equal(plain.head.weight, base.head.weight)  # frozen, unchanged; LoRA is not merged


def test_a_buffer_the_checkpoint_lacks_keeps_its_built_value_with_strict_false(tmp_path):
    model = RotaryLM()
    torch.save(model.state_dict(), tmp_path / "old.pt")
    state = nbshard.run(sharded_models.with_counter_from, str(tmp_path / "old.pt"), nproc=2)
    assert state["counter"].item() == 7.0 and torch.equal(state["norm.weight"], model.norm.weight.detach())


def test_litgpt_lora_loads_a_base_checkpoint_sharded_in_one_call(tmp_path):
    pytest.importorskip("litgpt", reason="litgpt is a test dependency: pip install --no-deps litgpt (see .ci/run)")
    from litgpt.model import GPT

    torch.manual_seed(0)
    base = GPT(sharded_models.litgpt_config(lora=False)).eval()
    torch.save(base.state_dict(), tmp_path / "lit_model.pth")
    result = nbshard.run(sharded_models.litgpt_lora_from_base, str(tmp_path / "lit_model.pth"), nproc=2)
    state = result["state"]
    for key, value in base.state_dict().items():  # every base weight, under LoRA's own names
        lora_key = key.replace("qkv.weight", "qkv.linear.weight").replace("qkv.bias", "qkv.linear.bias")
        lora_key = lora_key.replace("lm_head.weight", "lm_head.linear.weight").replace("proj.weight", "proj.linear.weight")
        lora_key = lora_key.replace("proj.bias", "proj.linear.bias").replace("fc.weight", "fc.linear.weight").replace("fc.bias", "fc.linear.bias")
        assert torch.equal(state[lora_key], value), key
    lora_b = [key for key in state if key.endswith("lora_B")]
    assert lora_b and all(torch.count_nonzero(state[key]) == 0 for key in lora_b)  # LoRA starts as a no-op
    assert sorted(result["trainable"]) == sorted(key for key in state if "lora_" in key)
    with torch.no_grad():
        expected = base(sharded_models.LITGPT_TOKENS)
    assert torch.allclose(result["logits"], expected, atol=1e-5)


def test_gpt2_from_scratch_has_its_own_scaled_residual_init():
    result = nbshard.run(sharded_models.hugging_face_gpt2, nproc=2)
    state, layers = result["state"], sharded_models.tiny_gpt2_config().n_layer
    scaled = 0.02 / math.sqrt(2 * layers)  # GPT-2's residual projections, set by GPT2MLP's and GPT2Attention's init
    for layer in range(layers):
        for name in ("attn.c_proj", "mlp.c_proj"):
            std = state[f"transformer.h.{layer}.{name}.weight"].std().item()
            assert abs(std - scaled) < 0.1 * scaled, (name, std, scaled)
        std = state[f"transformer.h.{layer}.mlp.c_fc.weight"].std().item()
        assert abs(std - 0.02) < 0.002, std
    assert torch.equal(state["transformer.ln_f.weight"], torch.ones(64))
    assert torch.isfinite(result["logits"]).all()


def gpt2_as_the_hub_ships_it(folder):
    """GPT-2's checkpoint as on the hub: the base model's keys (no ``transformer.``), with the old
    ``attn.bias`` masks the model leaves aside."""
    from safetensors.torch import save_file
    from transformers import GPT2Model

    torch.manual_seed(3)
    base = GPT2Model(sharded_models.tiny_gpt2_config())
    state = {key: value.contiguous() for key, value in base.state_dict().items()}
    state.update({f"h.{layer}.attn.bias": torch.ones(1, 1, 32, 32) for layer in range(base.config.n_layer)})
    save_file(state, folder / "model.safetensors")
    return base


def test_a_base_model_checkpoint_loads_into_the_model_with_a_head(tmp_path):
    base = gpt2_as_the_hub_ships_it(tmp_path)
    result = nbshard.run(sharded_models.hugging_face_gpt2, str(tmp_path), nproc=2)
    for key, value in base.state_dict().items():
        assert torch.equal(result["state"][f"transformer.{key}"], value), key
    assert torch.equal(result["state"]["lm_head.weight"], base.wte.weight)  # tied to the embedding


def test_strict_false_that_fills_under_half_of_the_model_is_an_error(tmp_path):
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(sharded_models.tiny_llama_config()).save_pretrained(tmp_path)  # another model
    with pytest.raises(nbshard.JobFailed) as failed:
        nbshard.run(sharded_models.hugging_face_gpt2, str(tmp_path), False, nproc=2, show_ranks=[])
    cause = failed.value.__cause__
    assert isinstance(cause, ValueError), cause
    assert "fills only 0 of the model's" in str(cause) and "mostly random" in str(cause)
    assert "another model's checkpoint, or its keys are named differently" in str(cause)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_full_writes_torch_and_safetensors_files_that_load_as_written(tmp_path, dtype):
    from safetensors.torch import load_file

    state = nbshard.run(sharded_models.save_full_both_formats, str(tmp_path), dtype, nproc=2)
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    stored = load_file(tmp_path / "model.safetensors")
    assert list(loaded) == list(state) and sorted(stored) == sorted(state)
    for key, value in state.items():
        assert loaded[key].dtype == value.dtype == stored[key].dtype, key
        assert torch.equal(loaded[key], value) and torch.equal(stored[key], value), key
    assert loaded["head.weight"].untyped_storage().data_ptr() == loaded["embed.weight"].untyped_storage().data_ptr()  # tied: one storage
    model = sharded_models.WithCounter(vocab=1001).to(getattr(torch, dtype))
    model.load_state_dict(loaded)  # strict: every key, every shape
    model.load_state_dict(stored)


def test_litgpt_lora_merges_in_the_ranks_as_in_one_process():
    pytest.importorskip("litgpt")
    from litgpt.lora import GPT, merge_lora_weights

    result = nbshard.run(sharded_models.litgpt_merge_in_ranks, nproc=2)
    model = GPT(sharded_models.litgpt_config(lora=True))
    model.load_state_dict(result["before"])
    merge_lora_weights(model)  # litgpt's own merge, in one process
    expected = model.state_dict()
    assert result["merged"] == sum(1 for m in model.modules() if hasattr(m, "merged") and m.merged) > 0
    for key, value in expected.items():
        assert torch.allclose(result["after"][key], value, atol=1e-6), key
    before, after = result["logits"]
    assert torch.allclose(before, after, atol=1e-4)  # the merged model computes what the LoRA one did
