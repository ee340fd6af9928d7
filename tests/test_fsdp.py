"""nbshard.fsdp: only the shard in memory, on 2 CPU ranks with gloo."""

from __future__ import annotations

import pytest
import torch

import nbshard
import sharded_models
from sharded_models import TOKENS, RotaryLM

pytestmark = pytest.mark.timeout(180)


def reference(seed: int) -> RotaryLM:
    torch.manual_seed(seed)
    return RotaryLM()


def assert_same_state(state: dict, expected: dict) -> None:
    assert sorted(state) == sorted(expected)
    for key in expected:
        assert torch.equal(state[key], expected[key]), key


def test_init_from_scratch_is_bit_for_bit_a_single_process_init():
    result = nbshard.run(sharded_models.from_scratch, 0, nproc=2)
    model = reference(0)
    assert_same_state(result["state"], model.state_dict())
    assert result["shards_differ"], "each rank must hold its own part, not a copy of rank 0's"
    assert result["tied"] and "head.weight" in result["state"]
    assert torch.equal(result["state"]["head.weight"], result["state"]["embed.weight"])
    assert torch.equal(result["inv_freq"], model.inv_freq)  # a non-persistent buffer, right after meta
    assert torch.allclose(result["logits"], model(TOKENS).detach(), atol=1e-5)


def test_a_full_checkpoint_read_by_rank_0_fills_every_shard(tmp_path):
    model = reference(1)
    path = tmp_path / "full.pt"
    torch.save(model.state_dict(), path)
    result = nbshard.run(sharded_models.from_full_checkpoint, str(path), nproc=2)
    assert_same_state(result["state"], model.state_dict())
    assert result["tied"]
    assert torch.allclose(result["logits"], model(TOKENS).detach(), atol=1e-5)


def test_sharded_and_full_checkpoints_round_trip(tmp_path):
    folder, full_path = tmp_path / "sharded", tmp_path / "full.pt"
    trained = nbshard.run(sharded_models.train_and_save, str(folder), str(full_path), nproc=2)
    assert sorted(p.name for p in folder.iterdir() if p.suffix == ".distcp") == ["__0_0.distcp", "__1_0.distcp"]
    assert_same_state(nbshard.run(sharded_models.from_sharded_checkpoint, str(folder), nproc=2), trained)
    plain = RotaryLM()
    plain.load_state_dict(torch.load(full_path, weights_only=True))  # strict: every key, every shape
    assert_same_state(plain.state_dict(), trained)


def test_a_checkpoint_that_does_not_match_names_the_keys(tmp_path):
    state = reference(2).state_dict()
    del state["norm.bias"]
    state["blocks.0.up.weight"] = torch.zeros(3, 3)
    state["extra.weight"] = torch.zeros(1)
    path = tmp_path / "wrong.pt"
    torch.save(state, path)
    with pytest.raises(nbshard.JobFailed) as caught:
        nbshard.run(sharded_models.from_full_checkpoint, str(path), nproc=2)
    message = str(caught.value.__cause__)
    assert "Missing from it: norm.bias" in message and "Not in the model: extra.weight" in message
    assert "blocks.0.up.weight: the checkpoint has shape (3, 3), the model (128, 32)" in message


def test_a_sharded_checkpoint_of_another_model_names_the_keys(tmp_path):
    folder = tmp_path / "sharded"
    nbshard.run(sharded_models.train_and_save, str(folder), str(tmp_path / "full.pt"), nproc=2)
    with pytest.raises(nbshard.JobFailed, match=r"Missing from it: blocks\.3\.down\.bias"):
        nbshard.run(sharded_models.from_sharded_checkpoint, str(folder), nproc=2, kwargs={"depth": 4})


def test_a_parameter_without_reset_parameters_is_named():
    with pytest.raises(nbshard.JobFailed, match=r"no reset_parameters\(\) initializes scale"):
        nbshard.run(sharded_models.without_reset_parameters, nproc=2)


@pytest.mark.parametrize(("tied", "chunks", "options"), [
    (True, False, {}), (False, False, {}),
    (True, True, {}), (False, True, {"head_bias": True, "padding_idx": 5}),
], ids=["tied-units", "untied-units", "tied-chunks", "untied-bias-padding-chunks"])
def test_large_embeddings_and_heads_are_units_of_their_own_or_gathered_in_chunks(tied, chunks, options):
    vocab = 1001  # not a multiple of the 2 ranks: the last shard is shorter
    result = nbshard.run(sharded_models.large_vocabulary, vocab, tied, chunks, kwargs=options, nproc=2, return_all=True)
    layers = ["blocks.0", "blocks.1", "blocks.2"]
    assert result[0]["units"] == (layers if chunks else sorted([*layers, "embed", "head"])), result[0]["units"]
    assert result[0]["chunked"] == (["embed", "head"] if chunks else [])
    assert result[0]["tied"] is tied
    # One process, the ranks' batches: FSDP2 averages the ranks' gradients.
    torch.manual_seed(3)
    model = RotaryLM(vocab=vocab, tie=tied, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = sharded_models.rank_batches(vocab)
    logits = [model(batch) for batch in batches]
    for rank, expected in enumerate(logits):
        assert torch.allclose(result[rank]["logits"], expected.detach(), atol=1e-5), rank
    (sum(rank_logits.pow(2).mean() for rank_logits in logits) / 2).backward()
    optimizer.step()
    for key, value in model.state_dict().items():
        assert torch.allclose(result[0]["state"][key], value, atol=1e-6), key


def test_an_embedding_and_head_no_larger_than_a_layer_are_gathered_whole():
    # Chunks pay only where gathering a unit whole would raise the peak: here a layer is larger.
    result = nbshard.run(sharded_models.large_vocabulary, 200, False, True, nproc=2, return_all=True)  # 6,400 < 8,416
    assert result[0]["units"] == ["blocks.0", "blocks.1", "blocks.2", "embed", "head"], result[0]["units"]
    assert result[0]["chunked"] == []


def test_chunked_embeddings_and_heads_save_and_load_sharded_and_full(tmp_path):
    result = nbshard.run(sharded_models.large_vocabulary_round_trip, str(tmp_path / "sharded"), str(tmp_path / "full.pt"),
                         nproc=2)
    assert result["chunked"] == ["embed", "head"]
    states = result["states"]
    assert_same_state(states["from sharded"], states["trained"])
    assert_same_state(states["from full"], states["trained"])
    plain = RotaryLM(vocab=1001, tie=False, head_bias=True)
    plain.load_state_dict(torch.load(tmp_path / "full.pt", weights_only=True))  # strict: every key, every shape
    assert_same_state(plain.state_dict(), states["trained"])


def test_a_token_id_outside_a_chunked_embedding_is_an_index_error():
    with pytest.raises(nbshard.JobFailed, match=r"IndexError: index out of range in self: token ids must lie in \[0, 1001\)"):
        nbshard.run(sharded_models.embedding_out_of_range, nproc=2)


def test_default_blocks_leaves_small_modules_to_the_root():
    from nbshard.fsdp import default_blocks

    model = RotaryLM()  # vocabulary 64: the embedding is a quarter of a layer
    assert default_blocks(model) == list(model.blocks)
    assert default_blocks(torch.nn.Linear(4, 4)) == []


def test_cpu_models_return_freed_memory_at_unit_boundaries_and_train_the_same():
    by_default, on, off = (nbshard.run(sharded_models.step_returning_freed_memory, option, nproc=2)
                           for option in (None, True, False))
    # Before every unit's backward; in forward only before the chunked units (embedding, head), where
    # trims before the layers cost the step time and lowered no peak (benchmarks/step_time.py).
    assert by_default["trimmed"] == on["trimmed"] == {
        "forward": ["embed", "head"], "backward": ["", "blocks.0", "blocks.1", "blocks.2", "embed", "head"]}, on["trimmed"]
    assert off["trimmed"] == {"forward": [], "backward": []}
    assert_same_state(on["state"], off["state"])  # in-place ops on a unit's output still work


@pytest.mark.parametrize("kind", ["gpt2", "llama", "litgpt_lora"])
def test_a_model_checked_under_no_grad_first_trains_every_parameter_as_one_process_would(kind):
    if kind == "litgpt_lora":
        pytest.importorskip("litgpt")
    result = nbshard.run(sharded_models.train_after_eval, kind, nproc=2)
    model = sharded_models.plain_model(kind)
    model.load_state_dict(result["before"])
    if kind == "litgpt_lora":
        from litgpt.lora import mark_only_lora_as_trainable

        mark_only_lora_as_trainable(model)
    trainable = [name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]  # tied: each name
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    sharded_models.one_step(model, result["tokens"])
    optimizer.step()
    assert result["trainable"] == sorted(trainable)  # trainable_only saves what one process trains
    expected = model.state_dict()
    for key in expected:
        assert torch.allclose(result["after"][key], expected[key], atol=1e-5), key
    moved = [name for name in trainable if not torch.equal(result["after"][name], result["before"][name])]
    if kind != "litgpt_lora":  # (LoRA's A gets no gradient in a first step: B starts at zero)
        assert moved == trainable
