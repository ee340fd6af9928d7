"""pdb in a rank, answered from the cell: a real kernel driven through jupyter_client's stdin
channel (input_request, input_reply), as JupyterLab's input box answers."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

from nbshard.job import Job

pytestmark = pytest.mark.timeout(240)

# Rank 1 stops in a loop; rank 0 goes on to a collective and waits there for it.
PAUSING_JOB = '''
import os, nbshard

def train(steps):
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = 0
    for step in range(steps):
        total += (step + 1) * (rank + 1)
        if step == 2:
            breakpoint()
    summed = torch.tensor([float(total)])
    dist.all_reduce(summed)
    dist.destroy_process_group()
    return total, summed.item()
'''


def _answers(*lines: str):
    """Answer each prompt with the next line (then continue, should more come)."""
    pending = list(lines)
    return lambda prompt, shown: pending.pop(0) if pending else "c"


def test_breakpoint_in_one_rank_is_answered_in_the_cell(kernel) -> None:
    """breakpoint() on rank 1 only (debug_ranks): its prompt is the kernel's input request, pdb's
    output shows in the cell, the other rank is shown waiting where it is (in all_reduce), and
    `p`, `n` and `c` work; the job then returns as it would have."""
    kernel.execute(PAUSING_JOB)
    result, prompts = kernel.execute_answering(
        "print('returned', nbshard.run(train, 4, nproc=2, debug_ranks=[1]))", _answers("p total, rank", "n", "p step", "c"),
    )
    assert result.status == "ok", result.traceback + result.stdout
    assert prompts == ["(Pdb rank 1) "] * 4, prompts
    shown = result.stdout
    assert "rank 1 stopped in the debugger; where the other ranks are:" in shown, shown
    rank0 = shown.split("rank 0: ", 1)[1].split("\n> ", 1)[0]
    assert "all_reduce" in rank0 and "dist.all_reduce(summed)" in rank0, rank0  # its cell line, inside torch's collective
    assert "(12, 1)" in shown, shown  # p total, rank: (1 + 2 + 3) * 2 on rank 1
    assert "\n3\n" in shown, shown  # p step, after `n` ran the loop's header
    assert "returned (10, 30.0)" in shown, shown  # rank 0's value, as without the stop
    assert "(Pdb rank 0)" not in shown


def test_quit_in_the_debugger_stops_the_job(kernel) -> None:
    """`q` stops the job cleanly: the cell raises JobCancelled, and every rank is gone (the
    runs_dir fixture checks that none is left within 5 s)."""
    kernel.execute(PAUSING_JOB)
    result, prompts = kernel.execute_answering("nbshard.run(train, 4, nproc=2, debug_ranks=[1])", _answers("q"))
    assert prompts == ["(Pdb rank 1) "], prompts
    assert result.error is not None and result.error["ename"] == "JobCancelled", result.error
    assert "stopping train: a rank's debugger was quit" in result.stdout, result.stdout


def test_an_interrupt_at_a_ranks_prompt_stops_the_job(kernel) -> None:
    """The stop button while the cell's input box asks for rank 1's pdb command leaves the
    prompt and stops the job as anywhere else: JobInterrupted, every rank gone (runs_dir)."""
    kernel.execute(PAUSING_JOB)

    def interrupt(prompt: str, shown: str) -> str:
        kernel.manager.interrupt_kernel()
        time.sleep(0.5)
        return "c"  # too late: were the prompt still open, the job would return

    result, prompts = kernel.execute_answering("nbshard.run(train, 4, nproc=2, debug_ranks=[1])", interrupt)
    assert prompts == ["(Pdb rank 1) "], prompts
    assert result.error is not None and result.error["ename"] == "JobInterrupted", result.error
    assert "train was interrupted, and its ranks were stopped" in result.traceback, result.traceback


def test_a_collective_timing_out_under_a_paused_rank_is_said_at_once(kernel) -> None:
    """Rank 0's collective gives up (a 3 s process-group timeout) while rank 1 waits in pdb:
    the cell says so while the prompt is still open, and the job fails with rank 0's error."""
    kernel.execute(PAUSING_JOB.replace('dist.init_process_group("gloo")',
                                       'import datetime; dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))'))
    seen_before_answer: list[str] = []

    def answer(prompt: str, shown: str) -> str:
        import time

        deadline = time.monotonic() + 60
        while "waited in the debugger" not in kernel_stdout() and time.monotonic() < deadline:
            time.sleep(0.2)
        seen_before_answer.append(kernel_stdout())
        return ""

    pending = {}

    def kernel_stdout() -> str:  # what the cell showed so far, read while the prompt is open
        kernel._drain_iopub(pending["id"], pending["result"])
        return pending["result"].stdout

    original = kernel._drain_iopub

    def remember(msg_id, result):
        pending.update(id=msg_id, result=result)
        original(msg_id, result)

    kernel._drain_iopub = remember
    result, prompts = kernel.execute_answering("nbshard.run(train, 4, nproc=2, debug_ranks=[1])", answer)
    assert prompts == ["(Pdb rank 1) "], prompts
    assert "rank 0 failed while rank 1" in seen_before_answer[0] and "waited in the debugger" in seen_before_answer[0], seen_before_answer
    assert "timeout" in seen_before_answer[0]
    assert result.error is not None and result.error["ename"] == "JobFailed", result.error
    assert "failed on rank 0" in result.traceback, result.traceback


def test_nobody_to_answer_lets_the_ranks_go_on(kernel) -> None:
    """Where the frontend takes no input (nbconvert, papermill), the ranks go on, pass over
    later breakpoints, and the cell says why once."""
    kernel.execute(PAUSING_JOB)
    result = kernel.execute("print('returned', nbshard.run(train, 4, nproc=2))")
    assert result.status == "ok", result.traceback + result.stdout
    assert "returned (10, 30.0)" in result.stdout
    assert result.stdout.count("nobody can answer here") == 1, result.stdout


def test_session_breakpoint_and_post_mortem(kernel) -> None:
    """In a session: a cell's breakpoint is answered in the cell; after a failed call,
    %shard_debug opens pdb at the failing frame of the rank that raised, with its locals, its
    frames walkable; leaving it returns the session to ready."""
    kernel.execute("import nbshard\n%load_ext nbshard\n%shard_session dbg --nproc 2")
    result, prompts = kernel.execute_answering(textwrap.dedent("""\
        %%shard_train --session dbg
        weights = [rank * 10 + i for i in range(3)]
        if rank == 0:
            breakpoint()
        print("after", sum(weights))
        """), _answers("p weights", "l", "c"))
    assert result.status == "ok", result.traceback
    assert prompts == ["(Pdb rank 0) "] * 3, prompts
    assert "[0, 1, 2]" in result.stdout and 'print("after", sum(weights))' in result.stdout, result.stdout  # `l` shows the cell
    assert "[rank0]: after 3" in result.stdout and "[rank1]: after 33" in result.stdout, result.stdout

    failed = kernel.execute(textwrap.dedent("""\
        %%shard_train --session dbg
        def scale(values, by):
            factor = 1 / by
            return [v * factor for v in values]
        out = scale(weights, rank - 1)
        """))
    assert failed.error is not None and failed.error["ename"] == "JobFailed", failed.error
    result, prompts = kernel.execute_answering("%shard_debug --session dbg", _answers("p by, factor if 'factor' in dir() else None", "up", "p weights", "where", "q"))
    assert result.status == "ok", result.traceback
    assert prompts == ["(Pdb rank 1) "] * 5, prompts
    shown = result.stdout
    assert "-> factor = 1 / by" in shown, shown
    assert "(0, None)" in shown, shown
    assert "[10, 11, 12]" in shown, shown  # the cell's locals, one frame up
    assert "where the other ranks are" not in shown  # a post-mortem holds nobody up
    after = kernel.execute("%%shard_train --session dbg\nprint('ready', rank)")
    assert after.status == "ok" and "[rank1]: ready 1" in after.stdout, after.stdout + after.traceback

    # The stop button at a post-mortem's prompt leaves pdb; the session is ready.
    assert kernel.execute("%%shard_train --session dbg\nscale(weights, rank - 1)").error is not None

    def interrupt(prompt: str, shown: str) -> str:
        kernel.manager.interrupt_kernel()
        time.sleep(0.5)
        return "p weights"  # too late: the prompt was left

    stopped, prompts = kernel.execute_answering("%shard_debug --session dbg", interrupt)
    assert prompts == ["(Pdb rank 1) "], prompts
    assert stopped.status == "ok" and "[nbshard] interrupted: leaving the debugger" in stopped.stdout, stopped.stdout + stopped.traceback
    last = kernel.execute("%%shard_train --session dbg\nprint('ready at last', rank)")
    assert last.status == "ok" and "[rank1]: ready at last 1" in last.stdout, last.stdout + last.traceback

    # Where the frontend takes no input, the post-mortem says so and leaves pdb: the session is ready.
    assert kernel.execute("%%shard_train --session dbg\nscale(weights, rank - 1)").error is not None
    unanswered = kernel.execute("%shard_debug --session dbg")
    assert unanswered.status == "ok", unanswered.traceback
    assert "rank 1 kept its error for a post-mortem, but nobody can answer pdb here" in unanswered.stdout, unanswered.stdout
    again = kernel.execute("%%shard_train --session dbg\nprint('ready again', rank)")
    assert again.status == "ok" and "[rank0]: ready again 0" in again.stdout, again.stdout + again.traceback
    kernel.execute("nbshard.session('dbg').close()")


def test_shard_debug_says_what_to_do_without_a_failure(kernel) -> None:
    kernel.execute("import nbshard\n%load_ext nbshard")
    none = kernel.execute("%shard_debug")  # a UsageError: IPython shows its message alone
    assert "UsageError: %shard_debug debugs a session's last failed call: name the session with --session NAME" in none.stderr, none.stderr
    kernel.execute("%shard_session ok --nproc 1\n%%shard_train --session ok\nx = 1")
    result = kernel.execute("%shard_debug --session ok")
    assert "its last call raised nowhere" in result.stderr, result.stderr
    kernel.execute("nbshard.session('ok').close()")


def test_torch_distributed_breakpoint_and_pdb_set_trace(script, tmp_path: Path) -> None:
    """torch.distributed.breakpoint(rank) and pdb.set_trace() use the same prompt; in a script
    the terminal answers (here, a pipe)."""
    (tmp_path / "answers.txt").write_text("p rank\nc\np rank\nc\n")
    runner = script(f"""
        import sys, nbshard
        sys.stdin = open({str(tmp_path / 'answers.txt')!r})

        def job():
            import pdb, torch.distributed as dist
            dist.init_process_group("gloo")
            rank = dist.get_rank()
            dist.breakpoint(rank=1)
            if rank == 0:
                pdb.set_trace()
            dist.destroy_process_group()
            return rank

        print("value", nbshard.run(job, nproc=2))
        """)
    code, output = runner.finish(timeout=120)
    assert code == 0, output
    assert "(Pdb rank 1) 1" in output and "(Pdb rank 0) 0" in output, output
    assert "value 0" in output


def test_debug_ranks_is_checked() -> None:
    with pytest.raises(ValueError, match="debug_ranks must list rank numbers"):
        Job(print, debug_ranks="1")
    assert Job(print, debug_ranks=[1, 2]).rank_env["NBSHARD_DEBUG_RANKS"] == "1,2"
    assert "NBSHARD_DEBUG_RANKS" not in Job(print).rank_env


def test_a_rank_on_another_node_is_answered_through_its_nodes_launcher(script, tmp_path: Path) -> None:
    """With two nodes (each its own launcher, as on Ray or Slurm), rank 1's prompt comes from
    node 1's launcher and the answer goes to that node alone."""
    (tmp_path / "answers.txt").write_text("p rank, world\nc\n")
    runner = script(f"""
        import sys, nbshard
        sys.stdin = open({str(tmp_path / 'answers.txt')!r})

        def job():
            import os
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            if rank == 1:
                breakpoint()
            return rank

        print("values", nbshard.run(job, nproc=1, nnodes=2, return_all=True))
        """)
    code, output = runner.finish(timeout=120)
    assert code == 0, output
    assert "(Pdb rank 1) (1, 2)" in output, output
    assert "values [0, 1]" in output
