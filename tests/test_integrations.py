"""Real third-party libraries in the ranks: their objects shipped there, their launchers called
there (skipped where not installed)."""

from __future__ import annotations

import os
import subprocess
import sys

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


def train_through_notebook_launcher(num_processes):
    """What a notebook's accelerate code does, run as a job: ``notebook_launcher(train, ...)``."""
    import torch
    from accelerate import notebook_launcher

    seen = []

    def train(tag):
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        seen.append({"tag": tag, "pid": os.getpid(), "processes": accelerator.num_processes, "index": accelerator.process_index,
                     "precision": accelerator.mixed_precision, "sum": accelerator.reduce(torch.tensor(1.0), "sum").item()})
        # One write: the processes share the rank's pipe, and print's text and newline are two.
        os.write(1, f"trained: process {accelerator.process_index} of {accelerator.num_processes}\n".encode())

    returned = notebook_launcher(train, ("cell",), num_processes=num_processes, mixed_precision="bf16")
    return {"seen": seen, "pid": os.getpid(), "returned": returned, "precision_after": os.environ.get("ACCELERATE_MIXED_PRECISION")}


def test_notebook_launcher_in_a_job_trains_in_the_ranks_nbshard_started():
    # Each rank used to start num_processes more on accelerate's port 29500: they clashed, and
    # nbshard took it for its own port being taken (restarting the ranks twice in vain).
    pytest.importorskip("accelerate")
    handle = nbshard.submit(train_through_notebook_launcher, 2, nproc=2, return_all=True)
    for rank, result in enumerate(handle.result()):
        assert result["seen"] == [{"tag": "cell", "pid": result["pid"], "processes": 2, "index": rank, "precision": "bf16", "sum": 2.0}]
        assert result["returned"] is None and result["precision_after"] is None  # as notebook_launcher leaves it
    assert "notebook_launcher runs the function in each of the 2 ranks nbshard started" in handle.logs(0)
    assert "notebook_launcher" not in handle.logs(1)


def test_notebook_launcher_asked_for_other_processes_than_the_ranks_says_so():
    pytest.importorskip("accelerate")
    with pytest.raises(nbshard.JobFailed, match=r"num_processes=4, but nbshard started 2 ranks.*\(nproc=4 for nbshard, or num_processes=2\)"):
        nbshard.run(train_through_notebook_launcher, 4, nproc=2)


def test_notebook_launcher_in_a_job_of_one_rank_starts_its_processes_as_anywhere():
    pytest.importorskip("accelerate")
    handle = nbshard.submit(train_through_notebook_launcher, 2, nproc=1)
    assert handle.result()["seen"] == []  # not in the rank: in notebook_launcher's two processes
    assert sorted(line for line in handle.logs(0).splitlines() if line.startswith("trained")) == [
        "trained: process 0 of 2", "trained: process 1 of 2"]


def test_launchers_imported_before_the_rank_started_are_patched_too():
    # A warm rank, forked from a process that preloaded lightning or accelerate, finds them imported.
    pytest.importorskip("lightning")
    pytest.importorskip("accelerate")
    code = (
        "import accelerate, lightning.pytorch.strategies.launchers.multiprocessing as trainer_side\n"
        "from nbshard.process import inner_launchers\n"
        "inner_launchers.install()\n"
        "import lightning.fabric.strategies.launchers.multiprocessing as fabric_side, accelerate.launchers\n"
        "print(*(getattr(f, '__nbshard_in_rank__', False) for f in (trainer_side._MultiProcessingLauncher.launch,\n"
        "      fabric_side._MultiProcessingLauncher.launch, accelerate.notebook_launcher, accelerate.launchers.notebook_launcher)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["True"] * 4, done.stderr
