"""Persistent sessions: ranks that stay up between calls, with nbshard's guarantees intact."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import time

import pytest

import nbshard
import session_jobs as jobs
from conftest import processes_of, wait_until_gone

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def session():
    started = nbshard.session("test", nproc=2, interrupt_grace=2)
    yield started
    started.close()
    assert not wait_until_gone(started.run_dir, within=5.0)


def test_the_ranks_and_what_they_hold_stay_between_calls_and_close_frees_them(session):
    pids = session.run(jobs.pid, return_all=True)
    assert session.run(jobs.init_gloo) == 2
    session.run(jobs.remember, {"lr": 0.1})
    assert session.run(jobs.recall) == {"lr": 0.1}
    assert session.run(jobs.all_reduce_sum, return_all=True) == [3.0, 3.0]
    assert session.run(jobs.pid, return_all=True) == pids
    assert nbshard.sessions() == [session] and nbshard.session("test") is session
    assert "gone" not in session._repr_html_() and "MiB" in session._repr_html_()
    session.close()
    assert session.state == "closed" and nbshard.sessions() == []
    shown = session._repr_html_()  # what the notebook shows of it now: no memory held by ranks that are gone
    assert shown.count(">gone<") == 2 and "peak" in shown, shown
    assert not wait_until_gone(session.run_dir, within=5.0)
    with pytest.raises(RuntimeError, match="closed; session.restart"):
        session.run(jobs.pid)


def test_a_session_in_a_with_block_is_closed_at_its_end_also_after_an_error():
    with pytest.raises(ZeroDivisionError):
        with nbshard.session("scoped", nproc=2) as scoped:
            assert scoped.run(jobs.pid, return_all=True)[0] != os.getpid()
            1 / 0
    assert scoped.state == "closed" and "scoped" not in [s.name for s in nbshard.sessions()]
    assert not wait_until_gone(scoped.run_dir, within=5.0)


def test_a_calls_metrics_memory_and_logs_are_its_own(session):
    first = session.submit(jobs.log_two_steps)
    first.result(timeout=60)
    assert sorted((m["rank"], m["step"], m["loss"]) for m in first.metrics()) == [
        (0, 1, 1.0), (0, 2, 0.5), (1, 1, 1.0), (1, 2, 0.5)
    ]
    second = session.submit(jobs.sleep_long)
    wait_for_lines(second, "sleeping", 2)
    assert "sleeping" not in first.logs(0) and "sleeping" in second.logs(0)
    # The memory the session holds shows from the call's start, before its first sample.
    assert all(view.current for view in second._telemetry.views())
    second.cancel()


def test_a_call_that_raises_in_every_rank_fails_with_its_traceback_and_the_session_lives_on(session):
    session.run(jobs.remember, 7)
    with pytest.raises(nbshard.JobFailed, match="failed in every rank.*lives on") as failed:
        session.run(jobs.raise_everywhere)
    assert isinstance(failed.value.__cause__, ValueError)
    assert "a bad learning rate in rank" in str(failed.value.__cause__)
    assert session.state == "running" and session.run(jobs.recall) == 7


def test_a_call_that_raises_in_some_ranks_marks_the_session_diverged(session):
    with pytest.raises(nbshard.JobFailed, match="diverged.*restart\\(\\) is advised") as failed:
        session.run(jobs.raise_on_rank_1)
    assert [f.rank for f in failed.value.failures] == [1]
    assert session.state == "diverged"
    assert session.run(jobs.rank, return_all=True) == [0, 1]  # it lives on


def test_a_value_that_cannot_be_sent_back_fails_the_call_but_the_session_has_not_diverged(session):
    for return_all in (False, True):  # rank 0's value alone, then every rank's
        with pytest.raises(nbshard.JobFailed, match="ran to its end in every rank.*could not be sent back.*lives on") as failed:
            session.run(jobs.count_then_return_a_lock, return_all=return_all)
        assert sorted(f.rank for f in failed.value.failures) == ([0, 1] if return_all else [0])  # the first to fail leads
        assert "cannot be pickled" in str(failed.value) and session.state == "running"
    assert session.run(jobs.counted_so_far, return_all=True) == [2, 2]  # both calls ran through in both ranks


def test_a_rank_left_waiting_for_one_that_raised_loses_the_session_with_its_stack(session):
    session.run(jobs.init_gloo)
    started = time.monotonic()
    with pytest.raises(nbshard.SessionLost, match="rank 0 did not leave the call within 2 s after rank 1 raised") as lost:
        session.run(jobs.raise_on_rank_1_while_rank_0_waits)
    assert time.monotonic() - started < 10
    first, second = lost.value.failures
    assert first.rank == 1 and "rank 1 raised before the barrier" in first.message
    assert second.rank == 0 and second.stopped and "barrier" in second.describe()
    assert not wait_until_gone(session.run_dir, within=5.0)
    with pytest.raises(nbshard.SessionLost, match="restart"):
        session.run(jobs.pid)


def test_an_answer_that_comes_after_the_session_was_lost_does_not_make_it_live_on(session):
    # interrupt_grace=2: lost at 2 s, SIGTERM (ignored) at 2.5 s, SIGKILL at 3.5 s; rank 0 answers at 3 s.
    with pytest.raises(nbshard.SessionLost, match="rank 0 did not leave the call within 2 s after rank 1 raised") as lost:
        session.run(jobs.raise_on_rank_0_after_the_session_was_lost, 3.0)
    assert [failure.rank for failure in lost.value.failures] == [1, 0] and lost.value.failures[1].stopped
    assert not wait_until_gone(session.run_dir, within=5.0)


def test_an_interrupted_call_ends_quickly_and_the_session_lives_on(session):
    session.run(jobs.remember, "kept")
    handle = session.submit(jobs.sleep_long)
    wait_for_lines(handle, "sleeping", 2)
    started = time.monotonic()
    assert handle.cancel()
    assert time.monotonic() - started < 2.0  # a Python-level call leaves at once
    assert isinstance(handle.exception(), nbshard.JobCancelled)
    assert "lives on" in str(handle.exception())
    assert session.run(jobs.recall) == "kept"


def test_a_call_past_its_timeout_is_interrupted_and_the_session_lives_on(session):
    session.run(jobs.remember, "kept")
    started = time.monotonic()
    with pytest.raises(nbshard.JobTimedOut, match="timeout of 1 s and was interrupted.*lives on"):
        session.run(jobs.sleep_long, timeout=1)
    assert time.monotonic() - started < 1 + 2
    assert session.run(jobs.recall) == "kept"


def test_an_interrupt_that_a_rank_stuck_in_a_collective_cannot_obey_loses_the_session(session):
    session.run(jobs.init_gloo)
    handle = session.submit(jobs.barrier_on_rank_0_sleep_on_rank_1)
    wait_for_lines(handle, "waiting", 2)
    time.sleep(0.5)  # rank 0 is inside the barrier
    started = time.monotonic()
    handle.cancel()
    assert time.monotonic() - started < 2 + 5  # the grace, then stacks and stopping
    lost = handle.exception()
    assert isinstance(lost, nbshard.SessionLost), lost
    assert "rank 0 did not leave the call within 2 s of the interrupt" in str(lost)
    assert "barrier" in str(lost)
    assert not wait_until_gone(session.run_dir, within=5.0)


def test_ranks_whose_collective_counts_disagree_lose_the_session(session):
    session.run(jobs.init_gloo)
    with pytest.raises(nbshard.SessionLost, match=r"no longer agree on the collectives they issued \(rank 0: 1, rank 1: 0\)"):
        session.run(jobs.extra_collective_on_rank_0)
    assert not wait_until_gone(session.run_dir, within=5.0)


def test_a_rank_killed_in_a_call_loses_the_session_and_is_named(session):
    with pytest.raises(nbshard.SessionLost, match="rank 1 was killed by SIGKILL") as lost:
        session.run(jobs.killed_on_rank_1)
    assert lost.value.failures[0].rank == 1 and lost.value.failures[0].signal == "SIGKILL"
    assert not wait_until_gone(session.run_dir, within=5.0)


def test_a_rank_killed_between_calls_is_named_by_the_next_call(session):
    pids = session.run(jobs.pid, return_all=True)
    os.kill(pids[1], signal.SIGKILL)
    assert not wait_until_gone(session.run_dir, within=5.0)
    with pytest.raises(nbshard.SessionLost, match="rank 1 was killed by SIGKILL"):
        session.run(jobs.pid)
    # It stays lost, and listed, until it is restarted or closed: no silent fresh ranks.
    assert nbshard.session("test") is session and nbshard.sessions() == [session] and session.state == "lost"
    session.restart()
    assert session.state == "running" and len(set(session.run(jobs.pid, return_all=True)) - set(pids)) == 2


def test_a_launcher_killed_from_outside_loses_the_session_saying_so(session):
    session.run(jobs.pid)
    os.kill(session.pid, signal.SIGKILL)
    assert not wait_until_gone(session.run_dir, within=5.0)  # its ranks go with it
    with pytest.raises(nbshard.SessionLost, match="its launcher was killed by SIGKILL \\(likely out of memory.*launcher.log"):
        session.run(jobs.pid)


def refuse_call(session, number: str, inline: str = "") -> str:
    """Send the launcher a call numbered ``number`` whose job does not hash to its digest; the
    message of rank 0's error, once the launcher ended the call as failed."""
    call = session.run_dir / "calls" / number
    session._command(f"run {number} {hashlib.sha256(b'something else').hexdigest()} 0 0 {inline}".rstrip())
    deadline = time.monotonic() + 30
    while not (call / "outcome.json").exists():
        assert time.monotonic() < deadline, "the launcher never ended the call"
        time.sleep(0.05)
    assert json.loads((call / "outcome.json").read_text())["status"] == "failed"
    return json.loads((call / "error-0.json").read_text())["message"]


def test_a_call_whose_file_does_not_match_its_hash_is_refused(session):
    call = session.run_dir / "calls" / "9999"
    call.mkdir(parents=True, mode=0o700)
    (call / "job.pkl").write_bytes(b"not what the kernel hashed")
    assert f"the job file {call / 'job.pkl'} is not the one the kernel wrote" in refuse_call(session, "9999")
    assert session.run(jobs.rank) == 0  # the session goes on


def test_a_small_call_travels_in_its_line_a_large_one_as_a_file_and_both_are_checked(session):
    from nbshard.kernel.persistent import INLINE_MAX

    small = session.submit(jobs.length, b"x" * 100)
    assert small.result() == 100
    large = session.submit(jobs.length, b"x" * (INLINE_MAX + 1))
    assert large.result() == INLINE_MAX + 1
    assert not (small.run_dir / "job.pkl").exists() and (large.run_dir / "job.pkl").exists()
    # A line whose job does not hash to its digest, or is not base64, is refused like a bad file.
    for number, job in (("9997", base64.b64encode(b"not what the kernel hashed").decode()), ("9998", "not-base64!")):
        (session.run_dir / "calls" / number).mkdir(mode=0o700)
        assert "the job sent with the call is not the one the kernel wrote" in refuse_call(session, number, job)
    assert session.run(jobs.rank) == 0  # the session goes on


def test_small_values_come_back_in_the_ranks_answers_large_ones_as_files(session):
    from nbshard.process.session_rank import VALUE_INLINE_MAX

    large = VALUE_INLINE_MAX + 1
    small = session.submit(jobs.bytes_by_rank, [100, 100], return_all=True)
    assert small.result() == [b"x" * 100] * 2
    assert set(small._values_sent()) == {0, 1}  # answered in the ranks' lines: no result file made
    mixed = session.submit(jobs.bytes_by_rank, [100, large], return_all=True)
    assert mixed.result() == [b"x" * 100, b"x" * large]
    assert set(mixed._values_sent()) == {0}
    # The file read is removed once the caller has been woken with its value: soon after.
    deadline = time.monotonic() + 2.0
    while list(mixed.run_dir.glob("result-*.pkl")):
        assert time.monotonic() < deadline, "the result file read was not removed"
        time.sleep(0.01)


def test_values_too_large_for_the_kernels_channel_come_as_files_the_launcher_writes():
    # Four ranks' values, each small enough for its answer, together over what the launcher sends
    # on the kernel's channel: the end goes on the wire and the values as result files.
    from nbshard.process.kernel_stream import REPLY_MAX
    from nbshard.process.session_rank import VALUE_INLINE_MAX

    assert 4 * (VALUE_INLINE_MAX - 200) * 4 // 3 > REPLY_MAX  # in base64
    session = nbshard.session("wide", nproc=4)
    try:
        sizes = [VALUE_INLINE_MAX - 100 - rank for rank in range(4)]
        handle = session.submit(jobs.bytes_by_rank, sizes, return_all=True)
        assert handle.result() == [b"x" * size for size in sizes]
        assert handle._values_sent() == {}
        assert session.run(jobs.rank) == 0
    finally:
        session.close()
    assert not wait_until_gone(session.run_dir, within=5.0)


def test_a_busy_session_refuses_a_second_call_and_restart_gives_new_ranks(session):
    pids, first_run_dir = session.run(jobs.pid, return_all=True), session.run_dir
    handle = session.submit(jobs.sleep_long)
    with pytest.raises(nbshard.SessionBusy, match=r"^sleep_long in session .* is still running, and a session runs one call at a time"):
        session.submit(jobs.pid)
    session.restart()  # interrupts the call first
    assert isinstance(handle.exception(), nbshard.JobCancelled)
    assert not set(session.run(jobs.pid, return_all=True)) & set(pids)
    assert not wait_until_gone(first_run_dir, within=5.0) and session.run_dir != first_run_dir


def test_session_options_are_checked():
    with pytest.raises(TypeError, match="unknown session option"):
        nbshard.session("x", npro=2)
    with pytest.raises(ValueError, match="interrupt_grace"):
        nbshard.session("x", interrupt_grace=0)
    for backend in ("ray", "slurm"):  # refused before anything starts: no engine is needed to say so
        with pytest.raises(ValueError, match=f"backend='{backend}' starts a launcher per node.*nbshard.run"):
            nbshard.session("x", backend=backend)
    assert nbshard.sessions() == []
    started = nbshard.session("x", nproc=1)
    try:
        with pytest.raises(ValueError, match="running with other nproc"):
            nbshard.session("x", nproc=2)
        with pytest.raises(TypeError, match="set when the session starts"):
            started.run(jobs.pid, nproc=2)
    finally:
        started.close()


class _NodeLaunchers:
    """What a registered backend that starts launchers per node returns (as Ray's and Slurm's
    node groups): not one launcher process of this kernel's."""

    def __init__(self, launcher):
        self.launcher, self.note = launcher, launcher.note

    def poll(self):
        return self.launcher.poll()

    def kill(self):
        self.launcher.kill()

    def close(self):
        self.launcher.close()


def test_a_backend_that_starts_node_launchers_is_refused_and_what_it_started_goes(runs_dir):
    from nbshard.backends import BACKENDS, register_backend
    from nbshard.backends.local import start_local

    register_backend("node-launchers", lambda run_dir, env, cwd, *, preload=None: _NodeLaunchers(start_local(run_dir, env, cwd, preload=None)))
    try:
        with pytest.raises(ValueError, match="starts a launcher per node"):
            nbshard.session("nodes", nproc=1, backend="node-launchers")
    finally:
        del BACKENDS["node-launchers"]
    assert nbshard.sessions() == []
    assert not wait_until_gone(runs_dir, within=5.0)


def test_a_notebook_function_sees_the_sessions_names_and_keeps_what_it_binds(script, runs_dir):
    kernel = script(
        """
        import nbshard
        model = "the notebook's small model"
        lr = 0.1
        session = nbshard.session(nproc=2)
        def load():
            global model
            model = ["the ranks' model", int(__import__("os").environ["RANK"])]
        def use():
            return model, lr
        session.run(load)
        print("SEEN", session.run(use, return_all=True))
        session.close()
        """
    )
    code, out = kernel.finish(timeout=90)
    assert code == 0, out
    assert "SEEN [([\"the ranks' model\", 0], 0.1), ([\"the ranks' model\", 1], 0.1)]" in out


def test_spawned_children_see_the_notebooks_class_as_the_latest_call_shipped_it(script, runs_dir):
    # A session's rank keeps one file of the notebook's names for spawn-started children (DataLoader
    # workers), rewritten only when a call ships other ones: a redefined class must reach them.
    kernel = script(
        """
        import nbshard
        session = nbshard.session(nproc=2)
        class Squares:
            def __len__(self): return 4
            def __getitem__(self, i): return i * i
        def total():
            import torch
            loader = torch.utils.data.DataLoader(Squares(), batch_size=4, num_workers=1, multiprocessing_context="spawn")
            return int(sum(batch.sum() for batch in loader))
        def quiet():
            return 1
        print("FIRST", session.run(total), session.run(total))
        class Squares:
            def __len__(self): return 4
            def __getitem__(self, i): return i * i * 10
        print("SECOND", session.run(total))
        handle = session.submit(quiet); handle.result()
        print("QUIET LOGS", sorted(p.name for p in handle.run_dir.iterdir() if p.name.endswith(".log")), repr(handle.logs(0)))
        session.close()
        """
    )
    code, out = kernel.finish(timeout=110)
    assert code == 0, out
    assert "FIRST 14 14" in out and "SECOND 140" in out, out
    assert "QUIET LOGS [] ''" in out, out  # a call that prints nothing costs no log file


def test_a_killed_kernel_takes_the_sessions_ranks_along_within_5_seconds(script, runs_dir):
    kernel = script(
        """
        import nbshard, session_jobs
        session = nbshard.session(nproc=2)
        session.run(session_jobs.pid)
        print("ready", flush=True)
        import time; time.sleep(120)
        """
    )
    kernel.wait_for("ready")
    run_dir = next(runs_dir.iterdir())
    assert len(processes_of(run_dir)) == 3  # the launcher and two ranks
    kernel.process.kill()
    assert not wait_until_gone(run_dir, within=5.0)


def wait_for_lines(handle: nbshard.JobHandle, text: str, count: int, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while sum(handle.logs(r).count(text) for r in range(handle.world_size)) < count:
        assert time.monotonic() < deadline, handle.logs()
        time.sleep(0.05)


def test_session_cells_share_the_ranks_names_which_win_over_the_notebooks(kernel):
    assert kernel.execute("%load_ext nbshard\nmodel = 'the notebook small model'\nscale = 10").status == "ok"
    first = kernel.execute("%%shard_train --session s --nproc 2\nmodel = [rank] * 3\nprint('loaded', flush=True)")
    assert first.status == "ok", first.traceback
    assert "[rank0]: loaded" in first.stdout and "[rank1]: loaded" in first.stdout
    second = kernel.execute("%%shard_train --session s --pull seen\nseen = (model, scale)")
    assert second.status == "ok", second.traceback
    assert kernel.execute("print(seen)").stdout.strip() == "([0, 0, 0], 10)"
    pushed = kernel.execute("%%shard_train --session s --push model --pull seen\nseen = model")
    assert pushed.status == "ok", pushed.traceback
    assert kernel.execute("print(seen)").stdout.strip() == "the notebook small model"
    listed = kernel.execute("import nbshard; print([s.name for s in nbshard.sessions()])")
    assert listed.stdout.strip() == "['s']"


def test_a_sessions_ranks_are_sent_a_notebook_cell_once_and_keep_it(kernel):
    # pdb and tracebacks in a rank show a cell's lines from its line cache; a session sends each
    # cell's source with the first call that needs it, and the ranks keep it for later calls.
    defined = kernel.execute(
        "import inspect, linecache, nbshard\ns = nbshard.session('cells', nproc=2)\n"
        "def source():\n    return inspect.getsource(source)\n"
        "def sent(handle):\n    return handle.result() == inspect.getsource(source), (handle.run_dir / 'sources.json').exists()"
    )
    assert defined.status == "ok", defined.traceback
    first = kernel.execute("print(sent(s.submit(source)))")
    assert first.stdout.strip() == "(True, True)", first.stdout + first.traceback
    again = kernel.execute("s.run(linecache.clearcache)\nprint(sent(s.submit(source)))")  # code a person ran cleared the cache
    assert again.stdout.strip().endswith("(True, False)"), again.stdout + again.traceback
    changed = kernel.execute("def source():\n    return inspect.getsource(source)  # edited\nprint(sent(s.submit(source)))")
    assert changed.stdout.strip() == "(True, True)", changed.stdout + changed.traceback
    kernel.execute("s.close()")


def test_a_session_cell_that_raises_reads_as_a_local_error_and_an_interrupt_keeps_the_session(kernel):
    assert kernel.execute("%load_ext nbshard").status == "ok"
    assert kernel.execute("%shard_session s --nproc 2").status == "ok"
    failed = kernel.execute("%%shard_train --session s\nx = 1\nraise ValueError(f'bad value in rank {rank}')")
    assert failed.error is not None and failed.error["ename"] == "JobFailed"
    kernel.assert_reads_as_a_local_error(failed)
    assert f"Cell In[{failed.execution_count}], line 3" in failed.traceback, failed.traceback
    assert "lives on" in failed.traceback
    msg_id = kernel.submit("%%shard_train --session s\nimport time\nprint('sleeping', flush=True)\ntime.sleep(60)")
    kernel.collect(msg_id, until=("[rank0]: sleeping", "[rank1]: sleeping"))
    started = time.monotonic()
    kernel.manager.interrupt_kernel()
    interrupted = kernel.collect(msg_id)
    assert time.monotonic() - started < 3
    assert interrupted.error is not None and interrupted.error["ename"] == "JobInterrupted"
    assert "session 's' lives on" in interrupted.traceback, interrupted.traceback
    kept = kernel.execute("%%shard_train --session s --pull x\nx = x + 1")
    assert kept.status == "ok", kept.traceback
    assert kernel.execute("print(x)").stdout.strip() == "2"
    closed = kernel.execute("%shard_session s --close\nimport nbshard; print(nbshard.sessions())")
    assert closed.stdout.strip().endswith("[]"), closed.stdout


def test_interrupting_a_session_cell_with_a_rank_stuck_in_a_collective_raises_session_lost(kernel):
    assert kernel.execute("%load_ext nbshard").status == "ok"
    assert kernel.execute("import nbshard\nnbshard.session('s', nproc=2, interrupt_grace=2)\n").status == "ok"
    msg_id = kernel.submit(
        "%%shard_train --session s\nimport time, torch.distributed as dist\ndist.init_process_group('gloo')\n"
        "print('waiting', flush=True)\nif rank == 0:\n    dist.barrier()\ntime.sleep(60)"
    )
    kernel.collect(msg_id, until=("[rank0]: waiting", "[rank1]: waiting"))
    time.sleep(0.5)
    kernel.manager.interrupt_kernel()
    lost = kernel.collect(msg_id, timeout=30)
    assert lost.error is not None and lost.error["ename"] == "SessionLost", lost.error
    assert "rank 0 did not leave the call within 2 s of the interrupt" in lost.traceback
    assert "Cell In[" in lost.traceback and "dist.barrier()" in lost.traceback  # where rank 0 was
    assert "--restart" in lost.traceback


def test_a_done_callback_may_run_the_next_call_and_wait_for_it(session):
    # The session's thread ends each call; a callback that waits for another call must not run on it.
    chained = []
    first = session.submit(jobs.pid)
    first.add_done_callback(lambda done: chained.append(session.run(jobs.pid)))
    first.result(timeout=60)
    deadline = time.monotonic() + 30
    while not chained:
        assert time.monotonic() < deadline, "the chained call never ended"
        time.sleep(0.05)
    assert chained == [first.result()]


def test_a_calls_end_comes_back_on_the_kernels_channel_after_every_line_it_printed(script, runs_dir):
    # The launcher answers a call's end on the kernel's own socket (a hop shorter than the wire),
    # but only once the wire's lines sent before it arrived: the cell shows all of them first.
    kernel = script(
        """
        import nbshard
        from nbshard.backends import channel
        ends = []
        original = channel.Channel.replies
        def counted(self, seen):
            due = original(self, seen)
            ends.extend(message["call"] for message in due if message.get("kind") == "end")
            return due
        channel.Channel.replies = counted
        session = nbshard.session(nproc=2)
        def chatty():
            import os
            for i in range(3000):
                print(f"line {os.environ['RANK']}-{i}")
            return "returned"
        for call in ("FIRST", "SECOND"):
            print(call, session.run(chatty), flush=True)
        print("ENDS ON THE CHANNEL", ends)
        session.close()
        """
    )
    code, out = kernel.finish(timeout=90)
    assert code == 0, out
    assert "ENDS ON THE CHANNEL ['0001', '0002']" in out, out
    first, second = out.index("FIRST returned"), out.index("SECOND returned")
    for rank in (0, 1):
        for start, end in ((0, first), (first, second)):
            shown = [out.index(f"line {rank}-{i}\n", start) for i in (0, 1500, 2999)]
            assert shown == sorted(shown) and shown[-1] < end, out[-3000:]
