"""Jobs travel by value; what cannot travel is named, with the path that reached it."""

from __future__ import annotations

import pickle
import socket
import sys
import threading

import pytest

from nbshard.pickling import dump_job
from nbshard.results import dump_result

LOCK = threading.Lock()


def uses_global_lock():
    with LOCK:
        return 1


def test_a_global_the_function_uses_is_named():
    this_module = sys.modules[__name__]  # by value, as cells of a notebook's __main__ travel
    with pytest.raises(TypeError) as caught:
        dump_job(uses_global_lock, (), {}, by_value=(this_module,))
    message = str(caught.value)
    assert "uses_global_lock.__globals__['LOCK']" in message
    assert "_thread.lock" in message
    assert "create it inside the function" in message


def test_a_closure_variable_is_named():
    with socket.socket() as connection:

        def train():
            return connection.fileno()

        with pytest.raises(TypeError, match=r"train \(closure variable 'connection'\)"):
            dump_job(train, (), {})


def test_a_nested_argument_is_named():
    config = {"optim": {"lr": 0.1, "lock": threading.Lock()}}
    with pytest.raises(TypeError, match=r"args\[1\]\['optim'\]\['lock'\]"):
        dump_job(print, (1, config), {})
    with pytest.raises(TypeError, match=r"kwargs\['cfg'\]\['optim'\]\['lock'\]"):
        dump_job(print, (), {"cfg": config})


def test_lambdas_and_local_classes_travel_by_value():
    class Local:
        def __init__(self, value):
            self.value = value

    payload = dump_job(lambda cfg: Local(cfg).value * 2, (21,), {})
    fn, args, kwargs = pickle.loads(payload)
    assert fn(*args, **kwargs) == 42


def test_results_keep_their_values():
    value = {"loss": 0.5, "history": [1, 2, 3]}
    assert pickle.loads(dump_result(value)) == value


def test_an_unpicklable_result_is_named():
    with pytest.raises(TypeError, match=r"the returned value\['lock'\]"):
        dump_result({"lock": threading.Lock()})


def test_a_value_nested_deeper_than_pickle_follows_says_so_both_ways():
    nested: list = []
    for _ in range(sys.getrecursionlimit() * 20):
        nested = [nested]
    with pytest.raises(TypeError, match=r"nests deeper than pickle can follow.*sys.setrecursionlimit") as caught:
        dump_result(nested)
    assert "tied to the rank's process" not in str(caught.value)  # not a lock or a file
    with pytest.raises(TypeError, match=r"nests deeper than pickle can follow"):
        dump_job(len, (nested,), {})


def test_result_tensors_come_back_equal_in_every_shape_and_kind():
    import torch

    values = {
        "bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "view": torch.arange(12.0).reshape(3, 4).t()[1:],  # not contiguous
        "int64": torch.arange(5),
        "complex": torch.tensor([1 + 2j]),
        "param": torch.nn.Parameter(torch.ones(2, 2)),
        "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False),
    }
    back = pickle.loads(dump_result(values))
    for name, tensor in values.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert torch.equal(back[name].detach(), tensor.detach()), name
        assert back[name].requires_grad == tensor.requires_grad, name
        assert type(back[name]) is type(tensor), name
    back["int64"][0] = 7  # writable, with memory of its own


MODULE_TABLE = bytes(8 << 20)  # read by a function that travels by reference, so it is not sent


def reads_the_module_table(data: bytes) -> int:
    return len(MODULE_TABLE) + len(data)


def test_a_large_job_warns_naming_what_makes_it_large(monkeypatch):
    import warnings

    import nbshard
    from nbshard.kernel import payload

    monkeypatch.setattr(payload, "LARGE_JOB", 2 << 20)
    blob = bytes(3 << 20)

    def train():  # a closure travels by value, with what it reads
        return len(blob)

    def step():  # reads it through another function of the notebook's
        return train() + 1

    class Holder:
        def __init__(self):
            self.weights = bytes(4 << 20)

    class Opaque:  # looking into it raises: it is not named, the others are
        __slots__ = ()

        def __getattr__(self, name):
            raise RuntimeError(name)

    many = [float(i) for i in range(400_000)]  # sized from a sample: about 3.4 MiB pickled
    for job, named in [
        (nbshard.Job(step), r"'blob' \(3 MiB\)"),
        (nbshard.Job(len, (many, Opaque())), r"args\[0\] \(3 MiB\)"),
        (nbshard.Job(print, kwargs={"held": Holder(), "small": 1}), r"kwargs\['held'\] \(4 MiB\)"),
        (nbshard.Job(reads_the_module_table, (blob,)), r"args\[0\] \(3 MiB\)"),  # not MODULE_TABLE
    ]:
        with pytest.warns(nbshard.LargeJob, match=f"the job pickles to \\d MiB, mostly {named}: each rank loads") as caught:
            payload.pickled_job(job)
        assert caught[0].filename == __file__  # the user's line, not nbshard's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        payload.pickled_job(nbshard.Job(len, (bytes(1 << 20),)))  # under the mark: silent
