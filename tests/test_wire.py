"""Signed JSON messages over a real ZMQ socket, bound inside a private directory."""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path

import pytest
import zmq

from nbshard.wire import IPC_PATH_MAX, Receiver, Sender, decode, encode, new_key


@pytest.fixture
def private_dir():
    """A short directory only this user can enter, as a run directory is (mode 0700)."""
    path = Path(tempfile.mkdtemp(prefix="wire-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def receive_all(receiver: Receiver, count: int, within: float = 5.0) -> list[dict]:
    messages: list[dict] = []
    deadline = time.monotonic() + within
    while len(messages) < count and time.monotonic() < deadline:
        messages += receiver.receive(0.1)
    return messages


def receive_until_rejected(receiver: Receiver, rejected: int, within: float = 2.0) -> list[dict]:
    """What arrives until ``rejected`` frames were dropped (or ``within`` seconds passed)."""
    messages: list[dict] = []
    deadline = time.monotonic() + within
    while receiver.rejected < rejected and time.monotonic() < deadline:
        messages += receiver.receive(0.1)
    return messages


def test_encode_decode_round_trip():
    key = new_key()
    message = {"kind": "lines", "rank": 1, "lines": [[1.5, "out", "héllo", False]]}
    assert decode(key, encode(key, message)) == message


def test_wrong_key_missing_signature_and_garbage_are_refused():
    key = new_key()
    [frame] = encode(key, {"kind": "end"})
    signature, payload = frame[:64], frame[64:]
    assert decode(new_key(), [frame]) is None
    assert decode(key, [payload]) is None
    assert decode(key, [b"", frame]) is None
    assert decode(key, [signature, payload]) is None  # two frames, as before: refused
    assert decode(key, [frame + b" "]) is None
    assert decode(key, [frame[:-1]]) is None


def test_sender_to_receiver_in_order(private_dir):
    key = new_key()
    receiver = Receiver(key, private_dir)
    assert receiver.address == f"ipc://{private_dir}/wire.sock"  # no TCP port: only this user can connect
    assert stat.S_IMODE(os.stat(private_dir / "wire.sock").st_mode) == 0o600
    sender = Sender(receiver.address, key)
    for index in range(500):
        assert sender.send({"kind": "event", "index": index})
    sender.close()
    messages = receive_all(receiver, 500)
    receiver.close()
    assert [m["index"] for m in messages] == list(range(500))


def test_an_interrupt_anywhere_in_a_send_never_spoils_the_next_message(private_dir):
    """The stop button raises KeyboardInterrupt at whatever bytecode a rank runs, also inside
    ``log_metrics``' send. Raised at each point of a send in turn, the message after it still
    arrives whole and signed: a send queues all of a message or none of it."""
    key = new_key()
    receiver = Receiver(key, private_dir)
    sender = Sender(receiver.address, key)
    points = 0
    while True:
        points += 1
        executed = 0

        def interrupt_at_point(frame, event, arg):
            nonlocal executed
            frame.f_trace_opcodes = True
            if event == "opcode":
                executed += 1
                if executed == points:
                    raise KeyboardInterrupt
            return interrupt_at_point

        sys.settrace(interrupt_at_point)
        try:
            sender.send({"kind": "event", "interrupted_at": points})
            finished = True
        except KeyboardInterrupt:
            finished = False
        finally:
            sys.settrace(None)
        assert sender.send({"kind": "event", "after": points})
        if finished:
            break
    assert points > 20  # the interrupt landed at every bytecode of the send, the socket's included
    sender.close()
    messages = receive_all(receiver, 2 * points, within=3.0)
    receiver.close()
    assert sorted(m["after"] for m in messages if "after" in m) == list(range(1, points + 1))
    assert receiver.rejected == 0


def test_unsigned_frames_are_dropped_and_counted(private_dir):
    key = new_key()
    receiver = Receiver(key, private_dir)
    context = zmq.Context()
    intruder = context.socket(zmq.PUSH)
    intruder.connect(receiver.address)
    intruder.send_multipart(encode(new_key(), {"kind": "end"}))  # signed with another key
    intruder.send_multipart([b'{"kind": "end"}'])  # no signature at all
    intruder.send_multipart(encode(key, {"kind": "event", "ok": True, "from": "a", "seq": 1}))
    messages = receive_all(receiver, 1)
    messages += receive_until_rejected(receiver, 2)
    intruder.close(0)
    context.term()
    receiver.close()
    assert messages == [{"kind": "event", "ok": True}]
    assert receiver.rejected == 2


def test_sender_never_blocks_when_nobody_reads(private_dir):
    key = new_key()
    receiver = Receiver(key, private_dir)  # bound, but never read
    sender = Sender(receiver.address, key)
    started = time.monotonic()
    results = [sender.send({"kind": "lines", "text": "x" * 1000}) for _ in range(20_000)]
    sender.close()  # bounded by the linger, not by the unread queue
    elapsed = time.monotonic() - started
    receiver.close()
    assert not all(results), "a full queue must drop rather than grow without bound"
    assert elapsed < 10


def test_replayed_and_reordered_frames_are_dropped_and_counted(private_dir):
    key = new_key()
    receiver = Receiver(key, private_dir)
    tap = zmq.Context.instance().socket(zmq.PULL)  # capture genuine frames as an eavesdropper would
    tap_port = tap.bind_to_random_port("tcp://127.0.0.1")
    sender = Sender(f"tcp://127.0.0.1:{tap_port}", key)
    for index in range(3):
        sender.send({"kind": "lines", "rank": 0, "lines": [[1.0, "out", f"line {index}", False]]})
    captured = [tap.recv_multipart() for _ in range(3)]
    sender.close()
    tap.close(0)
    replayer = zmq.Context.instance().socket(zmq.PUSH)
    replayer.connect(receiver.address)
    for frames in (captured[0], captured[1], captured[0], captured[1], captured[2], captured[1]):
        replayer.send_multipart(frames)
    shown = receive_all(receiver, 3)
    shown += receive_until_rejected(receiver, 3)
    replayer.close(0)
    receiver.close()
    assert [m["lines"][0][2] for m in shown] == ["line 0", "line 1", "line 2"]  # each once, in order
    assert receiver.rejected == receiver.replayed == 3


def test_oversized_frames_do_not_grow_the_kernel(private_dir):
    # The receiver runs in a process of its own so its peak memory is its own; a process of this
    # user (no other can reach the socket) sends whatever it likes.
    import subprocess
    import sys

    from conftest import REPO, pythonpath

    program = (
        "import resource, sys, time\n"
        "from nbshard.wire import Receiver, new_key\n"
        "receiver = Receiver(new_key(), sys.argv[2])\n"
        "print(receiver.address, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)\n"
        "deadline = time.monotonic() + float(sys.argv[1])\n"
        "while time.monotonic() < deadline:\n"
        "    receiver.receive(0.1)\n"
        "print(receiver.rejected, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)\n"
    )
    kernel = subprocess.Popen([sys.executable, "-c", program, "8", str(private_dir)], stdout=subprocess.PIPE, text=True,
                              env={**__import__("os").environ, "PYTHONPATH": pythonpath(REPO)})
    try:
        address, before_kib = kernel.stdout.readline().split()
        flood = zmq.Context.instance().socket(zmq.PUSH)
        flood.setsockopt(zmq.LINGER, 0)
        flood.connect(address)
        big = b"x" * (100 << 20)
        for _ in range(3):  # three unsigned 100 MB frames
            flood.send_multipart([b"sig", big])
        time.sleep(3)
        flood.close(0)
        rejected, after_kib = kernel.stdout.readline().split()
    finally:
        kernel.kill()
        kernel.wait()
    grown_mib = (int(after_kib) - int(before_kib)) / 1024
    assert grown_mib < 50, f"the kernel grew by {grown_mib:.0f} MiB"


def test_a_directory_too_deep_for_a_unix_socket_gets_a_short_private_one_removed_at_close(private_dir):
    deep = private_dir / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True, mode=0o700)
    key = new_key()
    receiver = Receiver(key, deep)
    spare = Path(receiver.address.removeprefix("ipc://")).parent
    assert len(os.fsencode(spare / "wire.sock")) <= IPC_PATH_MAX
    assert spare.name.startswith("nbshard-wire-") and stat.S_IMODE(os.stat(spare).st_mode) == 0o700
    sender = Sender(receiver.address, key)
    assert sender.send({"kind": "event", "index": 1})
    sender.close()
    assert receive_all(receiver, 1) == [{"kind": "event", "index": 1}]
    receiver.close()
    assert not spare.exists()
