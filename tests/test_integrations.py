"""Objects of real third-party libraries shipped to the ranks (skipped where not installed)."""

from __future__ import annotations

import pytest

import nbshard

pytestmark = pytest.mark.timeout(180)


def view_of(args):
    return {"world_size": args.world_size, "process_index": args.process_index, "device": str(args.device)}


def shipped_and_made_here(args):
    return view_of(args), view_of(training_arguments_made_here(args.output_dir))


def test_training_arguments_set_up_in_the_kernel_set_up_again_in_each_rank(tmp_path):
    # As Hugging Face tutorials do: TrainingArguments made (and used) in an earlier cell,
    # then shipped. Its cached device state says world size 1; each rank must set up its own.
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    assert args.world_size == 1 and "distributed_state" in vars(args)  # set up here, in the "kernel"
    views = nbshard.run(shipped_and_made_here, args, nproc=2, return_all=True)
    for rank, (shipped, made_in_the_rank) in enumerate(views):
        assert shipped == made_in_the_rank  # as if the rank had made it itself
        assert (shipped["world_size"], shipped["process_index"]) == (2, rank)
    assert args.world_size == 1 and "distributed_state" in vars(args)  # the kernel's own copy is untouched


def test_accelerate_state_objects_are_refused_with_what_to_do():
    accelerate = pytest.importorskip("accelerate")
    state = accelerate.PartialState(cpu=True)
    with pytest.raises(TypeError) as caught:
        nbshard.submit(lambda s: s.num_processes, state, nproc=2)
    message = str(caught.value)
    assert "args[0] (a accelerate.state.PartialState)" in message
    assert "Create it inside the job" in message and "a lock" not in message


def training_arguments_made_here(output_dir):
    import transformers

    return transformers.TrainingArguments(output_dir=output_dir, use_cpu=True, report_to=[])


def test_training_arguments_returned_to_the_kernel_carry_no_rank_state(tmp_path):
    pytest.importorskip("transformers")
    args = nbshard.run(training_arguments_made_here, str(tmp_path / "out"), nproc=2)
    assert args.world_size == 1 and args.output_dir == str(tmp_path / "out")
