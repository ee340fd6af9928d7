"""Signed JSON messages over a real loopback ZMQ socket."""

from __future__ import annotations

import time

import zmq

from nbshard.wire import Receiver, Sender, decode, encode, new_key


def receive_all(receiver: Receiver, count: int, within: float = 5.0) -> list[dict]:
    messages: list[dict] = []
    deadline = time.monotonic() + within
    while len(messages) < count and time.monotonic() < deadline:
        messages += receiver.receive(0.1)
    return messages


def test_encode_decode_round_trip():
    key = new_key()
    message = {"kind": "lines", "rank": 1, "lines": [[1.5, "out", "héllo", False]]}
    assert decode(key, encode(key, message)) == message


def test_wrong_key_missing_signature_and_garbage_are_refused():
    key = new_key()
    signature, payload = encode(key, {"kind": "end"})
    assert decode(new_key(), [signature, payload]) is None
    assert decode(key, [payload]) is None
    assert decode(key, [b"", payload]) is None
    assert decode(key, [signature, payload + b" "]) is None


def test_sender_to_receiver_in_order_over_loopback():
    key = new_key()
    receiver = Receiver(key)
    assert receiver.address.startswith("tcp://127.0.0.1:")
    sender = Sender(receiver.address, key)
    for index in range(500):
        assert sender.send({"kind": "event", "index": index})
    sender.close()
    messages = receive_all(receiver, 500)
    receiver.close()
    assert [m["index"] for m in messages] == list(range(500))


def test_unsigned_frames_are_dropped_and_counted():
    key = new_key()
    receiver = Receiver(key)
    context = zmq.Context()
    intruder = context.socket(zmq.PUSH)
    intruder.connect(receiver.address)
    intruder.send_multipart(encode(new_key(), {"kind": "end"}))  # signed with another key
    intruder.send_multipart([b'{"kind": "end"}'])  # no signature at all
    intruder.send_multipart(encode(key, {"kind": "event", "ok": True}))
    messages = receive_all(receiver, 1)
    deadline = time.monotonic() + 2
    while receiver.rejected < 2 and time.monotonic() < deadline:
        messages += receiver.receive(0.1)
    intruder.close(0)
    context.term()
    receiver.close()
    assert messages == [{"kind": "event", "ok": True}]
    assert receiver.rejected == 2


def test_sender_never_blocks_when_nobody_reads():
    key = new_key()
    receiver = Receiver(key)  # bound, but never read
    sender = Sender(receiver.address, key)
    started = time.monotonic()
    results = [sender.send({"kind": "lines", "text": "x" * 1000}) for _ in range(20_000)]
    sender.close()  # bounded by the linger, not by the unread queue
    elapsed = time.monotonic() - started
    receiver.close()
    assert not all(results), "a full queue must drop rather than grow without bound"
    assert elapsed < 10
