"""%%shard_train in a real IPython kernel, driven through jupyter_client."""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import processes_of, wait_until_gone

pytestmark = pytest.mark.timeout(180)

NOTEBOOK_STATE = '''
%load_ext nbshard
import math
import threading

class Scale:
    def __init__(self, factor):
        self.factor = factor

def helper(x):
    return Scale(cfg["factor"]).factor * x

cfg = {"factor": 3, "n": 4}
unused_lock = threading.Lock()   # not read by the cells: must not be shipped
'''


@pytest.fixture
def notebook(kernel):
    assert kernel.execute(NOTEBOOK_STATE).status == "ok"
    return kernel


def test_a_cell_runs_on_every_rank_and_pulls_values_back(notebook):
    result = notebook.execute(
        "%%shard_train --nproc 2 --pull values,who\n"
        "print(f'hello from {rank} of {world_size}')\n"
        "values = [helper(i) + math.floor(0.5) for i in range(cfg['n'])]\n"
        "who = rank\n"
    )
    assert result.status == "ok", result.stderr + result.traceback
    assert "[rank0]: hello from 0 of 2" in result.stdout and "[rank1]: hello from 1 of 2" in result.stdout
    assert "[nbshard]: pulled values, who into the notebook (rank 0's)" in result.stdout
    assert notebook.execute("print(values, who)").stdout.strip() == "[0, 3, 6, 9] 0"


def test_a_cell_that_ships_a_large_notebook_value_says_which(notebook):
    assert notebook.execute("blob = bytes(70 * 2**20)").status == "ok"
    result = notebook.execute("%%shard_train --nproc 1 --pull n\nn = len(blob)")
    assert result.status == "ok", result.traceback
    assert "LargeJob: the job pickles to 70 MiB, mostly 'blob' (70 MiB): each rank loads its own copy" in result.stderr
    assert notebook.execute("print(n)").stdout == f"{70 * 2**20}\n"


def test_pull_all_gives_a_list_indexed_by_rank(notebook):
    result = notebook.execute("%%shard_train --nproc 2 --pull-all --pull square\nsquare = rank * rank + 1")
    assert result.status == "ok", result.stderr + result.traceback
    assert notebook.execute("print(square)").stdout.strip() == "[1, 2]"


def test_a_pulled_name_the_cell_never_assigned_fails_the_pull_not_the_cell(notebook, tmp_path):
    (tmp_path / "markers").mkdir()
    marker = str(tmp_path / "markers" / "marker")
    result = notebook.execute(f"%%shard_train --nproc 2 --pull done,typo\nopen(f'{marker}-{{rank}}', 'w').close()\ndone = rank + 1")
    assert result.status == "error" and result.error["ename"] == "PullFailed", result.traceback
    assert "typo: the cell never assigned it in this rank" in result.traceback
    assert "Pulled done into the notebook" in result.traceback
    assert notebook.execute("print(done)").stdout.strip() == "1"
    assert sorted(p.name for p in (tmp_path / "markers").iterdir()) == ["marker-0", "marker-1"]  # the cell ran to its end in both ranks


def test_a_pulled_name_that_cannot_travel_costs_only_itself(notebook):
    result = notebook.execute(
        "%%shard_train --nproc 2 --pull before,lock,after\n"
        "import threading\n"
        "before = rank + 10\n"
        "lock = threading.Lock()  # tied to the rank's process, like a Trainer\n"
        "after = [rank, 'ok']\n"
    )
    assert result.status == "error" and result.error["ename"] == "PullFailed"
    text = result.traceback
    assert "lock: Cannot send the result back: the pulled 'lock' (a _thread.lock)" in text
    assert "state_dict()" in text and "arguments" not in text  # a hint written for results
    assert "Pulled before, after into the notebook" in text  # what it did bind, by name
    notebook.assert_reads_as_a_local_error(result)
    assert notebook.execute("print(before, after, 'lock' in globals())").stdout.strip() == "10 [0, 'ok'] False"


def test_each_cell_is_a_fresh_job(notebook):
    notebook.execute("%%shard_train --nproc 1\nleftover = 1")
    result = notebook.execute("%%shard_train --nproc 1 --pull seen\nseen = 'leftover' in globals()")
    assert result.status == "ok", result.stderr + result.traceback
    assert notebook.execute("print(seen)").stdout.strip() == "False"


def test_the_cell_namespace_holds_only_what_the_cell_needs(notebook):
    result = notebook.execute("%%shard_train --nproc 1 --pull names\nnames = sorted(n for n in globals() if not n.startswith('__'))")
    assert result.status == "ok", result.stderr + result.traceback
    assert notebook.execute("print(names)").stdout.strip() == "['rank', 'world_size']"


def test_tensors_and_torch_save_of_a_cell_class_work(notebook, tmp_path):
    notebook.execute("import torch\nclass Tiny(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.w = torch.nn.Parameter(torch.ones(2))")
    result = notebook.execute(
        f"%%shard_train --nproc 2 --pull weights\n"
        f"model = Tiny()\n"
        f"if rank == 0:\n"
        f"    torch.save(model, {str(tmp_path / 'tiny.pt')!r})\n"
        f"weights = model.w.detach() * (rank + 1)\n"
    )
    assert result.status == "ok", result.stderr + result.traceback
    check = notebook.execute(
        f"print(weights.tolist(), type(torch.load({str(tmp_path / 'tiny.pt')!r}, weights_only=False)).__name__)"
    )
    assert check.stdout.strip() == "[1.0, 1.0] Tiny"


def test_show_ranks_and_spawn_dataloaders_over_a_dataset_from_an_earlier_cell(notebook):
    notebook.execute(
        "import torch\n"
        "class Squares(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n"
        "        return 8\n"
        "    def __getitem__(self, index):\n"
        "        return torch.tensor([float(index * index)])\n"
    )
    result = notebook.execute(
        "%%shard_train --nproc 2 --show-ranks 1 --pull total\n"
        "loader = torch.utils.data.DataLoader(Squares(), batch_size=4, num_workers=2, multiprocessing_context='spawn')\n"
        "total = sum(batch.sum().item() for batch in loader)\n"
        "print('total', total)\n"
    )
    assert result.status == "ok", result.stderr + result.traceback
    assert "[rank1]: total 140.0" in result.stdout and "[rank0]" not in result.stdout
    assert notebook.execute("print(total)").stdout.strip() == "140.0"


def test_a_failing_rank_fails_the_cell_with_the_cells_own_lines(notebook):
    result = notebook.execute(
        "%%shard_train --nproc 2\n"
        "def check(value):\n"
        "    if value > 0:\n"
        "        raise ValueError(f'rank {value} diverged')\n"
        "check(rank)\n"
    )
    assert result.status == "error" and result.error["ename"] == "JobFailed"
    text = result.traceback
    assert "raise ValueError(f'rank {value} diverged')" in text and "check(rank)" in text
    # numbered as the notebook shows the cell, %%shard_train being line 1
    assert f"Cell In[{result.execution_count}], line 4, in check" in text
    assert f"Cell In[{result.execution_count}], line 5" in text
    notebook.assert_reads_as_a_local_error(result)
    assert "ValueError: rank 1 diverged" in text


@pytest.mark.parametrize(
    ("cell", "message"),
    [
        ("%%shard_train --nproc x\npass", "invalid int value: 'x'"),
        ("%%shard_train --nproc 0\npass", "nproc must be a positive integer"),
        ("%%shard_train --bogus\npass", "unrecognized arguments: --bogus. The options: %shard_train?"),
        ("%%shard_train --nprocs 2\npass", "--nprocs (did you mean --nproc?)"),
        ("%%shard_train --nproc_per_node 2 --max_restarts 1\npass",
         "--nproc_per_node (did you mean --nproc?); --max_restarts (did you mean --max-restarts?)"),
        ("%shard_session s --num-processes 2", "--num-processes (did you mean --nproc?)"),
        ("%%shard_train --env NOEQUALS\npass", "--env takes KEY=VALUE"),
        ("%%shard_train --show-ranks first\npass", "--show-ranks takes rank numbers"),
        ("%%shard_train --nproc 2 --show-ranks 0,2\npass", "show_ranks names rank 2, but the job has 2 ranks (0 to 1)"),
        ("%%shard_train\n!nvidia-smi", "uses IPython syntax: '!nvidia-smi'"),
        ("%%shard_train\n%time x = 1", "uses IPython syntax: '%time x = 1'"),
        ("%%shard_train\ndef broken(:\n    pass", "syntax error in cell line 2"),
        ("%%shard_train\nreturn model", "line 2: 'return' outside function. The cell runs as a plain script in each rank: assign the value"),
        ("%%shard_train\nimport asyncio\nawait asyncio.sleep(0)", "line 3: 'await' outside function. The cell runs as a plain script in each rank: put the async"),
        ("%shard_session s --restart --close", "--restart and --close contradict each other"),
        ("%%shard_train --push nothere\npass", "--push nothere: no such name"),
        ("%%shard_train --push unused_lock\npass", "Cannot ship the notebook's 'unused_lock'"),
        ("%%shard_train --max-restarts -1\npass", "max_restarts must be a whole number of restarts"),
        ("%%shard_train --nnodes 0\npass", "nnodes must be a positive integer"),
        ("%%shard_train --session s --nnodes 2\npass", "a session runs on one node"),
        ("%%shard_train --session s --max-restarts 1\npass", "a session keeps its ranks between cells"),
        ("%%shard_train --timeout nan\npass", "timeout must be a positive, finite number of seconds"),
        ("%%shard_train --grace nan\npass", "grace must be a positive, finite number of seconds"),
        ("%%shard_train --timeout inf\npass", "timeout must be a positive, finite number of seconds"),
        ("%%shard_train --session s --grace nan\npass", "grace must be a positive, finite number of seconds"),
        ("%%shard_train --pull 1x\nx = 1", "--pull 1x: not a Python name a cell can assign"),
        ("%%shard_train --pull 'a b'\nx = 1", "--pull 'a: not a Python name a cell can assign (quotes are kept as typed"),
        ("%%shard_train --push class\npass", "--push class: not a Python name a cell can assign"),
    ],
)
def test_bad_input_is_a_usage_error_and_starts_nothing(notebook, runs_dir, cell, message):
    result = notebook.execute(cell)
    assert result.reply["status"] == "error"
    assert "UsageError" in result.stderr and message in result.stderr, result.stderr
    assert not runs_dir.exists() or not any(runs_dir.iterdir())


def test_max_restarts_starts_a_failed_cell_again_and_says_why(notebook):
    result = notebook.execute(
        "%%shard_train --nproc 2 --max-restarts 1 --pull attempt\n"
        "import os\n"
        "attempt = int(os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
        "if attempt == 0 and rank == 1:\n"
        "    raise RuntimeError('lost a node')\n"
    )
    assert result.status == "ok", result.stderr + result.traceback
    assert "attempt 1 failed on rank 1: RuntimeError: lost a node; starting every rank again" in result.stdout
    assert notebook.execute("print(attempt)").stdout.strip() == "1"


def test_a_cell_on_two_nodes_sees_global_ranks(notebook):
    result = notebook.execute(
        "%%shard_train --nproc 1 --nnodes 2 --pull-all --pull node\n"
        "import os\n"
        "node = (rank, world_size, int(os.environ['GROUP_RANK']))\n"
    )
    assert result.status == "ok", result.stderr + result.traceback
    assert notebook.execute("print(node)").stdout.strip() == "[(0, 2, 0), (1, 2, 1)]"


def test_help_lists_the_options(notebook):
    payload = notebook.execute("%%shard_train?").reply["payload"]
    text = payload[0]["data"]["text/plain"]
    assert all(option in text for option in ("--nproc", "--pull", "--pull-all", "--push", "--noblock", "--gpus", "--max-restarts", "--nnodes"))


def test_noblock_binds_the_handle_and_shows_output_in_its_own_cell(notebook):
    launch = notebook.execute(
        "%%shard_train --nproc 2 --noblock training --pull total\n"
        "import sys, time\n"
        "for step in range(4):\n"
        "    print(f'step {step}', flush=True)\n"
        "    time.sleep(0.3)\n"
        "for percent in range(0, 101, 10):\n"
        "    sys.stderr.write(f'\\rprogress {percent}%'); sys.stderr.flush(); time.sleep(0.05)\n"
        "sys.stderr.write('\\n')\n"
        "total = rank + 100\n"
    )
    assert launch.status == "ok", launch.stderr + launch.traceback
    display_id = next(m for m in launch.messages if m["msg_type"] == "display_data")["content"]["transient"]["display_id"]
    other = notebook.execute(  # runs while the job does, and a little after it ended
        "import time\n"
        "for _ in range(600):\n"
        "    if training.done():\n"
        "        break\n"
        "    time.sleep(0.1)\n"
        "time.sleep(1.5)\n"
        "print('other cell', training.done())"
    )
    assert other.stdout.strip() == "other cell True"
    updates = [m for m in other.messages if m["msg_type"] == "update_display_data"]
    assert updates and all(u["content"]["transient"]["display_id"] == display_id for u in updates)
    final = updates[-1]["content"]["data"]["text/plain"].splitlines()
    assert "succeeded" in final[0] and "pulled total" in final[0]
    for rank in (0, 1):
        assert [line for line in final if line.startswith(f"[rank{rank}]: ")] == [
            *(f"[rank{rank}]: step {step}" for step in range(4)), f"[rank{rank}]: progress 100%"
        ]
    assert notebook.execute("print(total)").stdout.strip() == "100"


def test_interrupt_stops_the_cell_and_the_next_cell_runs(notebook, runs_dir):
    msg_id = notebook.submit("%%shard_train --nproc 2\nimport time\nprint('working', flush=True)\ntime.sleep(600)")
    started = notebook.collect(msg_id, until=("[rank0]: working", "[rank1]: working"))
    run_dir = next(runs_dir.iterdir())
    notebook.manager.interrupt_kernel()
    interrupted_at = time.monotonic()
    result = notebook.collect(msg_id)
    assert not wait_until_gone(run_dir, within=max(0.0, 5 - (time.monotonic() - interrupted_at)))
    notebook.assert_short_interrupt(result, f"Cell In[{started.execution_count}], line 4, in <module>")
    after = notebook.execute("%%shard_train --nproc 2 --pull ok\nok = True")
    assert after.status == "ok", after.stderr + after.traceback


def test_killing_the_kernel_during_a_cell_leaves_no_rank(notebook, runs_dir):
    msg_id = notebook.submit("%%shard_train --nproc 2\nimport time\nprint('working', flush=True)\ntime.sleep(600)")
    notebook.collect(msg_id, until=("[rank0]: working", "[rank1]: working"))
    assert len(processes_of(runs_dir)) == 3
    os.kill(notebook.pid, signal.SIGKILL)
    assert not wait_until_gone(runs_dir, within=5.0)


@pytest.mark.parametrize("session", ["", " --session tb"])
def test_a_traceback_shows_the_magic_line_as_the_cells_first_line(notebook, session):
    result = notebook.execute(f"%%shard_train --nproc 2{session}\nraise KeyError('missing')\n")
    assert result.status == "error" and result.error["ename"] == "JobFailed", result.stderr
    plain = result.traceback
    assert f"%%shard_train --nproc 2{session}" in plain  # the cell's first line, not a blank one
    assert "KeyError: 'missing'" in plain  # the rank's own exception: its args, not their text
    if session:
        notebook.execute("%shard_session tb --close")
