"""Code defined in the kernel's __main__ (a notebook's cells, a script) works in the ranks."""

from __future__ import annotations

import pytest

from nbshard.kernel.stages import LaunchStage

pytestmark = pytest.mark.timeout(180)


def test_functions_classes_and_lambdas_from_main_travel_by_value(script, tmp_path):
    kernel = script(
        """
        import nbshard

        class Scaler:
            def __init__(self, factor):
                self.factor = factor
            def __call__(self, x):
                return x * self.factor

        offset = 100
        add_offset = lambda x: x + offset

        def train(scaler):
            import os
            return add_offset(scaler(int(os.environ["RANK"]) + 1))

        print("values:", nbshard.run(train, Scaler(10), nproc=2, return_all=True))
        """
    )
    code, out = kernel.finish()
    assert code == 0, out
    assert "values: [110, 120]" in out


def test_pickling_by_reference_in_the_ranks_finds_main_classes(script, tmp_path):
    # torch.save pickles the model's class by reference (__main__.TinyNet), and
    # DataLoader workers started with spawn unpickle __main__.Squares: both must
    # be found in the ranks although they were defined in the kernel's __main__.
    checkpoint = tmp_path / "model.pt"
    kernel = script(
        f"""
        import torch, nbshard

        class Squares(torch.utils.data.Dataset):
            def __len__(self):
                return 8
            def __getitem__(self, index):
                return torch.tensor([float(index * index)])

        class TinyNet(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(1, 1)

        def train(path):
            import os
            rank = int(os.environ["RANK"])
            totals = {{}}
            for method in ("fork", "spawn", "forkserver"):
                loader = torch.utils.data.DataLoader(
                    Squares(), batch_size=4, num_workers=2, multiprocessing_context=method)
                totals[method] = sum(batch.sum().item() for batch in loader)
            if rank == 0:
                torch.save(TinyNet(), path)
                reloaded = torch.load(path, weights_only=False)
                totals["reloaded"] = type(reloaded).__name__
            return totals

        print("totals:", nbshard.run(train, {str(checkpoint)!r}, nproc=2))
        model = torch.load({str(checkpoint)!r}, weights_only=False)
        print("kernel loaded:", type(model).__name__, isinstance(model, TinyNet))
        """
    )
    code, out = kernel.finish(timeout=150)
    assert code == 0, out
    assert "totals: {'fork': 140.0, 'spawn': 140.0, 'forkserver': 140.0, 'reloaded': 'TinyNet'}" in out
    assert "kernel loaded: TinyNet True" in out


def test_a_failure_in_main_code_shows_its_source_lines(script):
    kernel = script(
        """
        import nbshard

        def check(value):
            if value < 0:
                raise ValueError(f"negative value: {value}")

        def train():
            check(-1)

        try:
            nbshard.run(train, nproc=2)
        except nbshard.JobFailed as error:
            import traceback
            print("".join(traceback.format_exception(error.__cause__)))
        """
    )
    code, out = kernel.finish()
    assert code == 0, out
    remote = out[out.index("\nTraceback"):]  # the kernel's rendering, not the streamed rank output
    assert "(raised in rank" in remote
    assert "kernel_script.py\", line 9, in train" in remote and "    check(-1)" in remote
    assert "raise ValueError(f\"negative value: {value}\")" in remote
    assert "ValueError: negative value: -1" in remote


def test_a_ranks_exception_arrives_as_the_same_object(script):
    kernel = script(
        """
        import errno, nbshard

        class Diverged(Exception):                  # a notebook's own class
            def __init__(self, step, loss):
                super().__init__(step, loss)
                self.step = step

        def fail(kind):
            import os, threading
            if os.environ["RANK"] != "1":
                return
            if kind == "key":
                {}["missing"]
            if kind == "args":
                raise ValueError("a", 2)
            if kind == "own":
                raise Diverged(7, float("nan"))
            if kind == "file":
                open("/nonexistent/nbshard-test")
            if kind == "torch":
                import torch.distributed
                raise torch.distributed.DistBackendError("NCCL error")
            if kind == "lock":
                error = RuntimeError("holds a lock")
                error.lock = threading.Lock()
                raise error

        def cause(kind):
            try:
                nbshard.run(fail, kind, nproc=2, show_ranks=[])
            except nbshard.JobFailed as failed:
                return failed.__cause__

        key = cause("key")
        print("key:", repr(key), key.args)
        print("args:", cause("args").args)
        own = cause("own")
        print("own:", isinstance(own, Diverged), own.step, own.args[0])
        missing = cause("file")
        print("file:", isinstance(missing, FileNotFoundError), missing.errno == errno.ENOENT, missing.filename)
        lock = cause("lock")
        print("lock:", type(lock).__name__, lock.__notes__[-1])
        import sys
        torch_error = cause("torch")
        print("torch:", type(torch_error).__module__, type(torch_error).__name__, "torch" in sys.modules)
        raise_it = cause("key")
        print("notes:", raise_it.__notes__)
        """
    )
    code, out = kernel.finish()
    assert code == 0, out
    assert "key: KeyError('missing') ('missing',)" in out  # not KeyError("'missing'")
    assert "args: ('a', 2)" in out
    assert "own: True 7 7" in out  # the notebook's class: isinstance holds, attributes intact
    assert "file: True True /nonexistent/nbshard-test" in out
    # What cannot be pickled is rebuilt from its text, and says so and why.
    assert "lock: RuntimeError (nbshard rebuilt this exception from its text: the exception.lock (a lock) could not be pickled in the rank" in out
    assert "notes: ['(raised in rank 1)']" in out
    # Unpickling torch's class would import torch into the kernel: rebuilt by name instead.
    assert "torch: torch.distributed DistBackendError False" in out


def test_a_scripts_traceback_shows_its_own_and_the_ranks_frames_not_nbshards(script):
    kernel = script(
        """
        import nbshard

        def train():
            raise KeyError("missing")

        nbshard.run(train, nproc=2, show_ranks=[])
        """
    )
    code, out = kernel.finish()
    assert code == 1
    traceback = out[out.index("Traceback"):]
    assert 'kernel_script.py", line 5, in train' in traceback  # the rank's frame
    assert 'kernel_script.py", line 7, in <module>' in traceback  # the script's
    assert "nbshard/" not in traceback.replace("nbshard/runs", ""), traceback  # none of nbshard's files
    assert "\nnbshard.errors.JobFailed: The job failed on rank" in traceback


def test_the_first_launch_says_it_is_cold_and_shows_its_stages(script):
    kernel = script(
        """
        import time, nbshard

        def job():
            import time
            time.sleep(1.0)
            return 1

        handle = nbshard.submit(job, nproc=2)
        stages = []
        while not handle.done():
            stage = handle.summary().split(": ", 1)[1].rsplit(" after", 1)[0]
            if not stages or stages[-1] != stage:
                stages.append(stage)
            time.sleep(0.01)
        print("stages:", stages)
        print("first:", handle.launch_note)
        handle.result()
        second = nbshard.submit(job, nproc=2)
        second.result()
        print("second:", second.launch_note)
        """
    )
    code, out = kernel.finish()
    assert code == 0, out
    stages = eval(out.split("stages: ", 1)[1].splitlines()[0])
    assert stages[0] == "starting its launcher (a fresh Python process)", stages
    assert "running" in stages and stages.index("running") > 0, stages  # each step in order, then running
    assert stages[-1] == "running", stages  # and never back
    assert "first: cold start: the first launch in this kernel starts fresh Python processes" in out
    assert "second: cold start: the first launch" not in out  # said once


def test_the_stage_only_moves_forward_whichever_socket_is_read_first():
    # The launcher's "started" and each rank's messages come on sockets of their own: on a busy
    # machine a rank's metrics can be read before its launcher's event, and the view must not
    # then say "starting its ranks" beside a chart of the job's loss.
    stage = LaunchStage(world_size=2, warm=True)
    assert stage.text == "starting its launcher"
    stage.follow({"kind": "sample", "rank": 0})
    assert stage.text == "loading the job in its ranks (its imports)"
    stage.follow({"kind": "stage", "stage": "running", "rank": 1})
    assert stage.text == "running in 1 of its ranks, loading in the others"
    stage.follow({"kind": "metrics", "rank": 0, "values": {"loss": 1.0}})
    assert stage.text == "running"
    for late in ({"kind": "event", "event": "started"}, {"kind": "sample", "rank": 1}, {"kind": "lines", "rank": 0}):
        stage.follow(late)
        assert stage.text == "running", late
    cold = LaunchStage(world_size=1, warm=False)
    cold.follow({"kind": "event", "event": "started"})
    assert cold.text == "starting its ranks"
    cold.follow({"kind": "lines", "rank": 0})  # a launcher that sends no stages
    assert cold.text == "running"
