"""profile=True: torch.profiler in every rank, each rank's trace and its summary in the cell."""

from __future__ import annotations

import json

import pytest

import nbshard

pytestmark = pytest.mark.timeout(120)


def matmul_and_all_reduce(steps: int, fail: bool = False) -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    x = torch.randn(128, 128)
    for _ in range(steps):
        y = x @ x
        dist.all_reduce(y)
    if fail:
        raise RuntimeError("stopped after the steps")
    return float(y.sum())


def test_each_rank_brings_back_its_top_operators_its_communication_share_and_a_trace():
    handle = nbshard.submit(matmul_and_all_reduce, 10, nproc=2, profile=True)
    handle.result()
    report = handle.profile()
    assert sorted(report.summaries) == [0, 1] and report.missing == []
    for rank, summary in report.summaries.items():
        names = [op["name"] for op in summary["ops"]]
        assert "aten::mm" in names and "c10d::allreduce_" in names, names
        mm = next(op for op in summary["ops"] if op["name"] == "aten::mm")
        assert mm["count"] == 10 and mm["self_us"] > 0
        assert 0 < summary["communication_us"] < summary["self_us"]
        trace = report.traces[rank]
        assert trace.parent == handle.run_dir / "profile" and trace.name == f"rank-{rank}.pt.trace.json"
        events = json.loads(trace.read_text())["traceEvents"]
        assert any(event.get("name") == "aten::mm" for event in events)  # what Perfetto and TensorBoard read
    shown = report._repr_html_()
    assert "rank 0" in shown and "rank 1" in shown and "communication" in shown and "aten::mm" in shown
    assert "c10d::allreduce_" in repr(report)


def test_a_failed_job_keeps_the_profile_of_what_ran():
    handle = nbshard.submit(matmul_and_all_reduce, 5, True, nproc=2, profile=True)
    with pytest.raises(nbshard.JobFailed):
        handle.result()
    report = handle.profile()
    assert sorted(report.summaries) == [0, 1]
    assert all(any(op["name"] == "aten::mm" and op["count"] == 5 for op in s["ops"]) for s in report.summaries.values())


def test_profile_is_asked_for_plainly():
    handle = nbshard.submit(matmul_and_all_reduce, 1, nproc=1)
    handle.result()
    with pytest.raises(ValueError, match="was not profiled: run it with profile=True"):
        handle.profile()
    with pytest.raises(TypeError, match="profile must be True or False"):
        nbshard.Job(print, profile="yes")
    session = nbshard.session("profiled", nproc=1)
    try:
        with pytest.raises(TypeError, match="a session's calls are not profiled"):
            session.run(nbshard.Job(print, profile=True))
    finally:
        session.close()


def test_the_magic_shows_each_ranks_profile_in_the_cell(kernel):
    assert kernel.execute("%load_ext nbshard\n", timeout=60).status == "ok"
    result = kernel.execute(
        "%%shard_train --nproc 2 --profile\n"
        "import torch\n"
        "x = torch.randn(64, 64)\n"
        "for _ in range(5):\n"
        "    x = torch.tanh(x @ x)\n",
        timeout=110,
    )
    assert result.status == "ok", result.traceback
    shown = [html for html in result.html(new_only=True) if "nbshard-profile" in html]
    assert len(shown) == 1 and "rank 0" in shown[0] and "rank 1" in shown[0] and "aten::mm" in shown[0], shown
