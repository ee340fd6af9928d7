"""Charts of a run: each rank's memory and every log_metrics series, as self-contained SVG."""

from __future__ import annotations

import re

import pytest

import nbshard
from nbshard.kernel.plots import MAX_POINTS, Chart, Plot, charts_of

pytestmark = pytest.mark.timeout(120)


def train(steps: int, with_steps: bool = True) -> int:
    import os
    import time

    rank = int(os.environ["RANK"])
    held = []
    for step in range(1, steps + 1):
        values = {"loss": 2.0 / step + rank, "lr": 0.001 * min(1, step / 5)}
        nbshard.log_metrics(step=step if with_steps else None, **values)
        held.append(bytearray(1 << 20))  # memory that grows
        time.sleep(0.03)
    return steps


def polyline_points(svg: str) -> list[list[tuple[float, float]]]:
    return [
        [tuple(map(float, pair.split(","))) for pair in points.split()]
        for points in re.findall(r'<polyline [^>]*points="([^"]+)"', svg)
    ]


def test_a_jobs_plot_draws_each_ranks_memory_and_every_metric_series():
    handle = nbshard.submit(train, 30, nproc=2, sample_interval=0.1)
    handle.result()
    plot = handle.plot()
    assert [chart.title for chart in plot.charts][1:] == ["loss", "lr"] and "memory" in plot.charts[0].title
    memory, loss, lr = plot.charts
    assert memory.x_label == "seconds" and memory.bytes and sorted(memory.series) == [0, 1]
    assert all(len(points) >= 3 for points in memory.series.values())
    assert loss.x_label == "step" and {rank: len(points) for rank, points in loss.series.items()} == {0: 30, 1: 30}
    assert loss.series[1][0] == (1.0, 3.0) and loss.series[0][-1] == pytest.approx((30.0, 2.0 / 30))
    html = plot._repr_html_()
    assert html.count("<svg") == 3 and "<script" not in html
    assert not re.search(r'(href|src)=|url\(|https?://(?!www\.w3\.org/2000/svg)', html)  # nothing fetched
    loss_svg = loss.svg()
    lines = polyline_points(loss_svg)
    assert len(lines) == 2 and all(len(line) == 30 for line in lines)
    falling = lines[0]
    assert all(a[1] <= b[1] for a, b in zip(falling, falling[1:]))  # loss falls: y grows downwards in SVG
    assert "rank 0" in loss_svg and "rank 1" in loss_svg and ">loss<" in loss_svg


def test_a_quick_jobs_seconds_count_from_its_submission_so_none_is_negative(monkeypatch):
    # A job may run whole before its launch returns (seen while the warm process still imports):
    # here the launch returns 1 s late. Its records still come after the time its charts count from.
    import time

    from nbshard.kernel import client

    launch = client.launch
    monkeypatch.setattr(client, "launch", lambda *args, **kwargs: (launch(*args, **kwargs), time.sleep(1.0))[0])
    handle = nbshard.submit(train, 1, False, nproc=2, sample_interval=0.05)
    handle.result()
    times = [record["time"] for record in handle.memory() + handle.metrics()]
    assert times and min(times) >= handle.started, (min(times) - handle.started, handle.started)
    assert all(x >= 0 for chart in handle.plot().charts for points in chart.series.values() for x, *_ in points)


def test_charts_over_seconds_start_at_the_runs_start_and_charts_over_steps_at_their_first_step():
    quick = Chart("memory", "seconds", {0: [(0.960, 2e7), (0.965, 2e7)]}, bytes=True, since_start=True).svg()
    dots = [float(x) for x in re.findall(r'<circle cx="([\d.]+)"', quick)]
    assert not polyline_points(quick) and len(dots) == 1 and dots[0] > 52 + 0.9 * 318  # a job that ran 1 s: a dot at its end
    later = polyline_points(Chart("memory", "seconds", {0: [(2.0, 2e7), (4.0, 3e7)]}, bytes=True, since_start=True).svg())
    assert later[0][0][0] == pytest.approx(52 + 318 * 2 / 4.16, abs=1)  # from 0 s, not from the first sample
    steps = polyline_points(Chart("loss", "step", {0: [(100.0, 1.0), (200.0, 2.0)]}).svg())
    assert steps[0][0][0] == pytest.approx(52, abs=1)  # the first step at the axis's left end


def test_metrics_without_steps_go_over_seconds_and_a_gpu_gets_its_own_memory_chart():
    started = 100.0
    memory = [
        {"rank": rank, "time": started + t, "cpu_rss": 3 << 30, "cpu_anon": (2 << 30) + t * (1 << 20), "cpu_pss_anon": None,
         "gpu_allocated": (10 + t) * (1 << 30), "gpu_used": (12 + t) * (1 << 30), "gpu_reserved": None}
        for rank in range(2) for t in range(5)
    ]
    metrics = [{"rank": 0, "time": started + t, "step": None, "throughput": 10.0 * t} for t in range(5)]
    cpu, gpu, throughput = charts_of(memory, metrics, started)
    assert (cpu.title, gpu.title, throughput.title) == ("memory: CPU anon", "memory: GPU", "throughput")
    assert gpu.series[1][-1] == (4.0, 16 * (1 << 30)) and cpu.series[0][0] == (0.0, 2 << 30)
    assert throughput.x_label == "seconds" and throughput.series == {0: [(float(t), 10.0 * t) for t in range(5)]}
    assert "memory: GPU (GiB)" in gpu.svg()


def test_a_long_series_is_thinned_but_keeps_its_spike_and_its_ends():
    points = [(float(i), 1.0) for i in range(20_000)]
    points[12_345] = (12_345.0, 50.0)
    svg = Chart("loss", "step", {0: points}).svg()
    (drawn,) = polyline_points(svg)
    assert len(drawn) <= MAX_POINTS + 2
    top = min(y for _, y in drawn)  # the highest value is the smallest y
    assert sum(1 for _, y in drawn if y == top) == 1  # the spike is there, once
    assert drawn[0][0] < drawn[1][0] and drawn[-1][0] == max(x for x, _ in drawn)


def test_a_plot_with_nothing_yet_says_so_and_saves_as_a_page(tmp_path):
    empty = Plot([], title="job on 2 ranks: running after 0 s")
    assert "no memory samples or metrics yet" in empty._repr_html_()
    page = Plot(charts_of([], [{"rank": 0, "time": 1.0, "step": 1, "loss": 0.5}], 0.0), title="t").save(tmp_path / "p.html")
    text = page.read_text()
    assert text.startswith("<!doctype html>") and text.count("<svg") == 1 and "<circle" in text  # one point: a dot


def test_a_sessions_plot_spans_its_calls():
    session = nbshard.session("plots", nproc=2, sample_interval=0.1)
    try:
        session.run(train, 3)
        session.run(train, 4)
        loss = next(chart for chart in session.plot().charts if chart.title == "loss")
        assert [len(loss.series[rank]) for rank in (0, 1)] == [7, 7]  # both calls' steps
    finally:
        session.close()


def test_the_live_view_in_a_notebook_draws_the_charts_while_the_job_runs(kernel):
    result = kernel.execute(
        "import nbshard, os, time\n"
        "def steps(count):\n"
        "    for step in range(1, count + 1):\n"
        "        nbshard.log_metrics(step=step, loss=1.0 / step)\n"
        "        time.sleep(0.1)\n"
        "nbshard.run(steps, 40, nproc=2, sample_interval=0.2)\n",
        timeout=110,
    )
    assert result.status == "ok", result.traceback
    views = result.html()
    drawn = [view for view in views if 'aria-label="loss"' in view]
    running = [view for view in drawn if ": running after" in view]
    assert len(set(running)) >= 2, len(views)  # redrawn in place as the job runs
    assert 'aria-label="loss"' in views[-1] and ": succeeded after" in views[-1]  # and kept at its end
    assert "<script" not in views[-1]
