"""An interrupt while the kernel waits for a job is raised where the wait checks for it,
never inside the lock of the event it waits on (``nbshard.kernel.interrupts``).

Each case runs in a Python process of its own: a SIGINT that the code under test let
through would otherwise interrupt pytest itself.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, pythonpath

pytestmark = pytest.mark.timeout(60)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a shell's background job ignores it: Python would then install no handler


def run_python(code: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=45,
        env={"PYTHONPATH": pythonpath(REPO), "PATH": "/usr/bin:/bin", **(env or {})}, preexec_fn=_default_sigint,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_an_interrupt_is_counted_until_the_check_raises_it():
    out = run_python("""
        import os, signal, time
        from nbshard.kernel.interrupts import deferred_interrupts
        with deferred_interrupts() as interrupts:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                time.sleep(0)  # calls and loops, where Python would have raised it
            print("pending", interrupts.pending)
            try:
                interrupts.check()
            except KeyboardInterrupt:
                print("raised at the check")
            interrupts.check()  # once per interrupt
        print("handler restored", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    """)
    assert out.split("\n")[:3] == ["pending 1", "raised at the check", "handler restored True"]


def test_a_wait_is_interrupted_within_a_slice_and_leaves_its_event_usable():
    out = run_python("""
        import os, signal, threading, time
        from nbshard.kernel import interrupts
        done = threading.Event()
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        started = time.monotonic()
        try:
            interrupts.wait(done)
        except KeyboardInterrupt:
            print("interrupted after", round(time.monotonic() - started, 1))
        print("lock free", not done._cond._lock.locked())
        threading.Thread(target=done.set).start()  # the thread that ends a job can still set it
        print("set seen", done.wait(5))
        print("timeout kept", interrupts.wait(threading.Event(), 0.2) is False)
    """)
    lines = out.split("\n")
    assert lines[0].startswith("interrupted after ") and 0.3 <= float(lines[0].split()[-1]) <= 0.3 + 0.1 + 0.3, out
    assert lines[1:4] == ["lock free True", "set seen True", "timeout kept True"]


def test_an_interrupt_left_unchecked_is_raised_when_the_block_ends():
    out = run_python("""
        import os, signal
        from nbshard.kernel.interrupts import deferred_interrupts
        try:
            with deferred_interrupts():
                os.kill(os.getpid(), signal.SIGINT)
                print("inside")
        except KeyboardInterrupt:
            print("raised at the end")
        try:
            with deferred_interrupts():
                os.kill(os.getpid(), signal.SIGINT)
                raise ValueError("the block's own error")
        except ValueError as error:
            print("its own error goes:", error)
    """)
    assert out.split("\n")[:3] == ["inside", "raised at the end", "its own error goes: the block's own error"]


def test_an_interrupt_raises_at_once_inside_what_waits_for_a_person():
    out = run_python("""
        import os, signal, threading, time
        from nbshard.kernel.interrupts import deferred_interrupts
        with deferred_interrupts() as interrupts:
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
            started = time.monotonic()
            waits_for_a_person = interrupts.raising_in(lambda prompt: time.sleep(10) or prompt)  # as input() does
            try:
                waits_for_a_person("(Pdb) ")
            except KeyboardInterrupt:
                print("left the wait after", round(time.monotonic() - started))
            print("counted again", signal.getsignal(signal.SIGINT) is not signal.default_int_handler)
    """)
    assert out.split("\n")[:2] == ["left the wait after 0", "counted again True"]


def test_other_handlers_and_other_threads_are_left_alone():
    out = run_python("""
        import signal, threading
        from nbshard.kernel.interrupts import deferred_interrupts
        def mine(signum, frame):
            pass
        signal.signal(signal.SIGINT, mine)
        with deferred_interrupts() as interrupts:
            print("custom handler kept", signal.getsignal(signal.SIGINT) is mine, interrupts.active)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        def in_thread():
            with deferred_interrupts() as interrupts:
                print("thread", interrupts.active)
        thread = threading.Thread(target=in_thread)
        thread.start()
        thread.join()
    """)
    assert out.split("\n")[:2] == ["custom handler kept True False", "thread False"]


# The stop button pressed while a job launches, once its launcher runs and before the handle that
# stops it exists (simulated there, deterministically): the launcher and its ranks must not
# outlive the cell (the runs_dir fixture fails a test that leaves a process behind).
INTERRUPTED_LAUNCH = """
    import os, signal, time
    import nbshard
    from conftest import wait_until_gone
    from nbshard.kernel import client, persistent

    def interrupted_here(wrapped):
        pressed = []
        def wrapper(*args, **kwargs):
            if not pressed:  # the first launch only
                pressed.append(True)
                os.kill(os.getpid(), signal.SIGINT)  # as the stop button would, now
                time.sleep(0.3)  # where Python would raise it
            return wrapped(*args, **kwargs)
        return wrapper

    {patch}
    try:
        {start}
    except KeyboardInterrupt as error:
        kept = error  # as IPython keeps the last error (sys.last_value), and with it every frame's locals
        print("interrupted")
    print("left running:", wait_until_gone(os.environ["NBSHARD_RUNS_DIR"], within=5.0))  # while this kernel lives
    print(nbshard.run(print, "the next launch works", nproc=1))
"""


@pytest.mark.parametrize("patch, start", [
    ("client.JobHandle = interrupted_here(client.JobHandle)", "nbshard.run(time.sleep, 600, nproc=2)"),
    ("persistent.Session._take_over = interrupted_here(persistent.Session._take_over)", "nbshard.session('s', nproc=2)"),
], ids=["run", "session"])
def test_an_interrupt_while_a_launch_starts_leaves_nothing_running(runs_dir, patch, start):
    out = run_python(INTERRUPTED_LAUNCH.format(patch=patch, start=start),
                     env={"NBSHARD_RUNS_DIR": str(runs_dir), "PYTHONPATH": pythonpath(REPO, REPO / "tests")})
    assert out.splitlines()[:2] == ["interrupted", "left running: {}"], out
    assert "the next launch works" in out, out


INTERRUPTED_CALL = """
import os, signal, time
import nbshard
from nbshard.kernel import persistent

sent = persistent.Session._command
pressed = []

def command(self, line):
    if line.startswith("run ") and not pressed:  # the call is the session's current one, its command not yet sent
        pressed.append(True)
        os.kill(os.getpid(), signal.SIGINT)  # as the stop button would, now
        time.sleep(0.3)  # where Python would raise it
    return sent(self, line)

persistent.Session._command = command
session = nbshard.session("s", nproc=2)
started = time.monotonic()
try:
    session.run(time.sleep, 600)
except KeyboardInterrupt:
    print("interrupted within 30 s:", time.monotonic() - started < 30)
print(session.run(print, "the next call works"))
session.close()
"""


def test_an_interrupt_while_a_session_call_starts_stops_that_call(runs_dir):
    """The stop button just as a call is sent: the call it started is interrupted (or was never
    sent), and the session takes the next call rather than refusing it as busy forever."""
    out = run_python(INTERRUPTED_CALL, env={"NBSHARD_RUNS_DIR": str(runs_dir)})
    assert out.splitlines()[0] == "interrupted within 30 s: True", out
    assert "the next call works" in out, out


INTERRUPTED_ANYWHERE = """
import signal, sys, time
import nbshard
from nbshard.kernel.persistent import SessionBusy


class InterruptAt:
    '''A trace function that raises KeyboardInterrupt at the ``point``-th place where a real
    SIGINT can: as a Python function starts and as a call returns (where CPython runs signal
    handlers), in nbshard's frames and the frames they call, while Python's own handler is in.'''

    def __init__(self, point):
        self.point, self.seen, self.raised_at = point, 0, None

    def __call__(self, frame, event, arg):
        if event == "call":
            caller = frame.f_back
            if "/nbshard/" not in frame.f_code.co_filename and not (caller and "/nbshard/" in caller.f_code.co_filename):
                return None
            frame.f_trace_lines = False
        if event in ("call", "return") and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self.seen += 1
            if self.seen == self.point:
                self.raised_at = f"{event} of {frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"
                raise KeyboardInterrupt
        return self


def next_call_works(session):
    deadline = time.monotonic() + 5
    while True:  # as a person would: the interrupted call may take a moment to end
        try:
            return session.submit(int).result(timeout=15) == 0
        except SessionBusy:
            if time.monotonic() > deadline:
                raise


session = nbshard.session("s", nproc=2)
for name, call in [("submit", lambda: session.submit(time.sleep, 0.005).result()),
                   ("run", lambda: session.run(time.sleep, 0.005))]:
    point = 0
    while True:
        point += 1
        interrupt = InterruptAt(point)
        sys.settrace(interrupt)
        try:
            call()
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        if interrupt.raised_at is None:
            break  # the call ran past its last point
        assert next_call_works(session), interrupt.raised_at
    print(name, "points", point - 1)
session.close()
"""


def test_an_interrupt_at_any_point_of_a_session_call_leaves_the_session_usable(runs_dir):
    """The stop button at each place in turn where Python can raise it during a session's call
    (``submit().result()`` and ``run``): every time, the next call works within seconds."""
    out = run_python(INTERRUPTED_ANYWHERE, env={"NBSHARD_RUNS_DIR": str(runs_dir)})
    counts = {line.split()[0]: int(line.split()[-1]) for line in out.splitlines() if " points " in line}
    assert counts.keys() == {"submit", "run"} and min(counts.values()) > 50, out


INTERRUPTED_CLOSE = """
import os, signal, time
import nbshard
from conftest import wait_until_gone
from nbshard.kernel import persistent

sent = persistent.Session._command

def command(self, line):
    if line == "close":
        os.kill(os.getpid(), signal.SIGINT)  # the stop button as the session closes
        time.sleep(0.3)  # where Python would raise it
    return sent(self, line)

persistent.Session._command = command
session = nbshard.session("s", nproc=2)
try:
    session.close()
except KeyboardInterrupt:
    print("interrupted")
print("state:", session.state, "listed:", nbshard.sessions())
print("left running:", wait_until_gone(os.environ["NBSHARD_RUNS_DIR"], within=5.0))
persistent.Session._command = sent
print(nbshard.session("s", nproc=2).run(print, "a new session works"))
"""


def test_an_interrupt_while_a_session_closes_still_closes_it(runs_dir):
    """The stop button during ``close()``: the ranks are killed rather than left running, and
    the name starts a new session rather than handing back the closed one."""
    out = run_python(INTERRUPTED_CLOSE, env={"NBSHARD_RUNS_DIR": str(runs_dir), "PYTHONPATH": pythonpath(REPO, REPO / "tests")})
    assert out.splitlines()[:3] == ["interrupted", "state: closed listed: []", "left running: {}"], out
    assert "a new session works" in out, out
