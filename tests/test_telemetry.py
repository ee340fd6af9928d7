"""Memory samples and metrics from the ranks, and the live view rendered from plain state."""

from __future__ import annotations

import io
import sys

import pytest

import nbshard
from nbshard.kernel.display import RankView, render_html, render_text, sparkline_svg
from nbshard.rank.memory_sample import sample_memory
from nbshard.rank.monitor import log_metrics
from nbshard.kernel.telemetry import Telemetry

pytestmark = pytest.mark.timeout(120)

MIB = 1024 * 1024


def hold_memory(megabytes, steps):
    import time

    import nbshard

    time.sleep(0.5)  # samples of the baseline first
    block = bytearray(megabytes * MIB)
    block[::4096] = b"x" * len(block[::4096])  # touch every page: resident, not just reserved
    for step in range(steps):
        nbshard.log_metrics(step=step, loss=1.0 / (step + 1), lr=0.1)
        time.sleep(0.25)
    return len(block)


def test_sample_memory_reads_resident_memory_and_touches_no_gpu():
    sample = sample_memory()
    assert sample["rss"] > 10 * MIB and sample["peak_rss"] >= sample["rss"]
    assert 0 < sample["anon"] < sample["rss"] and sample["peak_anon"] >= sample["anon"]
    assert sample["gpus"] == []  # CUDA is not initialized in this process: nothing is asked of it


def test_log_metrics_outside_a_rank_does_nothing_and_checks_its_values():
    assert log_metrics(step=1, loss=0.5) is False
    with pytest.raises(TypeError, match="numbers or one-element tensors"):
        log_metrics(loss="low")
    with pytest.raises(TypeError, match="step"):
        log_metrics(step=1.5, loss=0.5)


def test_telemetry_keeps_records_peaks_and_views():
    telemetry = Telemetry(nproc=2)
    for time, rss in ((1.0, 100 * MIB), (2.0, 300 * MIB), (3.0, 150 * MIB)):
        assert telemetry.add({"kind": "sample", "rank": 0, "time": time, "rss": rss, "peak_rss": max(rss, 300 * MIB), "gpus": []})
    telemetry.add({"kind": "metrics", "rank": 1, "time": 2.5, "step": 7, "values": {"loss": 0.25}})
    telemetry.last_line(1, "epoch 3")
    assert not telemetry.add({"kind": "sample", "rank": 5, "time": 1.0, "rss": 1, "peak_rss": 1})  # no such rank
    assert [r["cpu_rss"] for r in telemetry.memory()] == [100 * MIB, 300 * MIB, 150 * MIB]
    assert telemetry.metrics() == [{"rank": 1, "time": 2.5, "step": 7, "loss": 0.25}]
    assert telemetry.peaks() == {0: {
        "cpu_peak_rss": 300 * MIB, "cpu_peak_anon": None, "cpu_peak_pss": None, "cpu_peak_pss_anon": None,
        "gpu_peak_allocated": None, "gpu_peak_used": None,
    }}
    rank0, rank1 = telemetry.views()
    assert (rank0.device, rank0.current, rank0.peak) == ("CPU", 150 * MIB, 300 * MIB)
    assert rank0.history == [100 * MIB, 300 * MIB, 150 * MIB]
    assert (rank1.metrics, rank1.last_line, rank1.device) == ({"loss": 0.25, "step": 7}, "epoch 3", "")


def test_gpu_samples_show_the_memory_the_process_holds():
    telemetry = Telemetry(nproc=1)
    gpu = {"device": 0, "allocated": 2 * 1024**3, "reserved": 3 * 1024**3, "peak_allocated": 5 * 1024**3, "used": 4 * 1024**3}
    telemetry.add({"kind": "sample", "rank": 0, "time": 1.0, "rss": MIB, "peak_rss": MIB, "gpus": [gpu]})
    (view,) = telemetry.views()
    assert (view.device, view.current, view.peak) == ("GPU", 4 * 1024**3, 5 * 1024**3)
    assert "GPU 4.0 GiB (peak 5.0 GiB)" in render_text("job", [view])


def test_views_render_as_text_and_self_contained_html():
    views = [RankView(rank=0, device="GPU", current=2 * 1024**3, peak=3 * 1024**3, history=[1.0, 3.0, 2.0],
                      metrics={"loss": 0.125}, last_line="<b>step 5</b>")]
    text = render_text("train on 1 rank: running", views)
    assert text.splitlines() == ["train on 1 rank: running", "  rank 0 | GPU 2.0 GiB (peak 3.0 GiB) | loss=0.125 | <b>step 5</b>"]
    html = render_html("train <1>", views, tail="[rank0]: a < b")
    assert "<script" not in html and "http" not in html
    assert "&lt;b&gt;step 5&lt;/b&gt;" in html and "train &lt;1&gt;" in html and "a &lt; b" in html
    assert "<polyline" in html and "3.0 GiB" in html
    assert sparkline_svg([5.0]).count("<polyline") == 0


def test_a_steady_sparkline_is_drawn_as_steady_not_as_a_border():
    import re

    steady, moving = sparkline_svg([200.0 * MIB] * 5, height=24), sparkline_svg([100.0 * MIB, 200.0 * MIB, 150.0 * MIB], height=24)
    assert 'stroke-dasharray' in steady and "<title>steady at 200.0 MiB</title>" in steady
    assert 'stroke-dasharray' not in moving and "<title>100.0 MiB to 200.0 MiB</title>" in moving
    for svg in (steady, moving):
        ys = [float(y) for y in re.findall(r",([\d.]+)", svg.split('points="')[1].split('"')[0])]
        assert min(ys) >= 24 * 0.2, ys  # a quarter below the top: not along the cell's edge


def test_a_job_reports_each_ranks_memory_and_metrics():
    handle = nbshard.submit(hold_memory, 200, 6, nproc=2, sample_interval=0.2)
    shown = io.StringIO()
    handle.watch(shown)
    assert handle.result() == 200 * MIB
    memory = handle.memory()
    for rank in (0, 1):
        samples = [r for r in memory if r["rank"] == rank]
        assert len(samples) >= 4
        assert [r["time"] for r in samples] == sorted(r["time"] for r in samples)
        baseline = min(r["cpu_rss"] for r in samples)
        assert handle.peak_memory()[rank]["cpu_peak_rss"] - baseline >= 190 * MIB
        metrics = [m for m in handle.metrics() if m["rank"] == rank]
        assert [m["step"] for m in metrics] == list(range(6))
        assert metrics[-1]["loss"] == pytest.approx(1 / 6) and metrics[-1]["lr"] == 0.1
    assert "[nbshard]: peak memory: rank 0 CPU" in shown.getvalue()
    frame = handle.memory(frame=True)
    assert set(frame["rank"]) == {0, 1} and frame["cpu_peak_rss"].max() >= 200 * MIB
    assert list(handle.metrics(frame=True).columns) == ["rank", "time", "step", "loss", "lr"]


def read_memory_mapped(path):
    import time

    import torch

    import nbshard

    torch.zeros(1).sum()  # torch imported and warmed up before the baseline
    time.sleep(0.4)  # samples of the baseline
    nbshard.log_metrics(step=0)  # marks when loading starts
    tensor = torch.load(path, mmap=True, weights_only=True)
    total = float(tensor.sum())  # every page of the file is now resident, in the page cache
    time.sleep(0.6)
    return total


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_memory_mapped_checkpoint_counts_as_resident_but_not_as_the_ranks_own(tmp_path, monkeypatch, warm):
    import torch

    monkeypatch.setattr(nbshard.settings, "warm", warm)
    if warm:
        from test_warm import warm_ready

        warm_ready()
    torch.save(torch.ones(32 * MIB // 4), tmp_path / "checkpoint.pt")  # 32 MiB
    handle = nbshard.submit(read_memory_mapped, str(tmp_path / "checkpoint.pt"), nproc=1, sample_interval=0.1)
    shown = io.StringIO()
    handle.watch(shown)
    assert handle.result() == 32 * MIB // 4 and handle.warm is warm
    loading_starts = handle.metrics()[0]["time"]
    before = [r for r in handle.memory() if r["time"] < loading_starts][-1]
    peak = handle.peak_memory()[0]
    anonymous = "cpu_pss_anon" if warm else "cpu_anon"
    rss_growth = peak["cpu_peak_rss"] - before["cpu_rss"]
    anonymous_growth = peak[anonymous.replace("cpu_", "cpu_peak_")] - before[anonymous]
    assert rss_growth >= 30 * MIB and anonymous_growth < 16 * MIB, (rss_growth, anonymous_growth, peak)
    assert f"peak memory: rank 0 CPU anon{' PSS' if warm else ''} " in shown.getvalue()


def spike(megabytes, seconds):
    import time

    time.sleep(0.5)  # the first sample is taken
    held = b"x" * (megabytes * MIB)  # every page written: resident, anonymous
    time.sleep(seconds)
    del held
    time.sleep(0.3)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_spike_between_two_samples_counts_in_the_peak(monkeypatch, warm):
    monkeypatch.setattr(nbshard.settings, "warm", warm)
    # One sample when the rank starts, the next when it ends: 256 MiB held for 0.3 s in between.
    handle = nbshard.submit(spike, 256, 0.3, nproc=1, sample_interval=60)
    handle.result(timeout=60)
    first, last = handle.memory()
    assert last["cpu_anon"] - first["cpu_anon"] < 64 * MIB, (first, last)  # no sample saw the spike
    peak = handle.peak_memory()[0]
    assert peak["cpu_peak_anon"] - first["cpu_anon"] >= 250 * MIB, peak
    if handle.warm:
        assert peak["cpu_peak_pss_anon"] - first["cpu_pss_anon"] >= 250 * MIB, peak


def test_sampling_can_be_turned_off_while_metrics_still_arrive():
    handle = nbshard.submit(hold_memory, 1, 2, nproc=1, sample_interval=None)
    handle.result(timeout=60)
    assert handle.memory() == [] and len(handle.metrics()) == 2


def test_the_sampler_does_not_import_torch_or_cuda_into_a_rank(monkeypatch):
    monkeypatch.setattr(nbshard.settings, "warm", False)  # a warm rank has torch imported before it starts
    def modules_loaded():
        import time

        time.sleep(0.5)  # a few samples happen meanwhile
        return sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))

    assert nbshard.run(modules_loaded, nproc=1, sample_interval=0.1) == []


def import_torch_while_sampled():
    import time

    import torch

    time.sleep(0.05)  # a few more samples once torch is whole
    return torch.__version__


def test_the_sampler_survives_a_job_that_imports_torch_under_it(monkeypatch):
    monkeypatch.setattr(nbshard.settings, "warm", False)  # a warm rank imported torch before its sampler started
    # The job's main thread imports torch while the sampler reads it every 2 ms:
    # a half-imported torch means a sample without GPU figures, never a dead
    # thread or a traceback in the job's output.
    for _ in range(4):
        handle = nbshard.submit(import_torch_while_sampled, nproc=2, sample_interval=0.002)
        shown = io.StringIO()
        handle.watch(shown)
        handle.result(timeout=60)
        output = shown.getvalue() + handle.logs()
        assert "Exception in thread" not in output and "Traceback" not in output, output
        for rank in (0, 1):
            times = [r["time"] for r in handle.memory() if r["rank"] == rank]
            assert len(times) >= 20, f"rank {rank} sent {len(times)} samples"
            # samples kept coming after the import: the thread lived to the end
            assert max(times) >= handle.ended - 5 and max(times) > min(times) + 0.5


def log_many(count):
    import nbshard

    for step in range(count):
        nbshard.log_metrics(step=step, loss=1.0 / (step + 1))
    return count


def test_every_metric_is_kept_even_when_the_wire_drops_some():
    # 100,000 records a rank as fast as Python logs them: more than the wire's queue holds.
    handle = nbshard.submit(log_many, 100_000, nproc=2, sample_interval=None)
    handle.result(timeout=120)
    records = handle.metrics()
    for rank in (0, 1):
        steps = [r["step"] for r in records if r["rank"] == rank]
        assert steps == list(range(100_000))
    assert records[-1]["loss"] == pytest.approx(1 / 100_000)


def test_the_kernel_keeps_a_bounded_number_of_live_records():
    from nbshard.kernel.telemetry import KEPT

    telemetry = Telemetry(nproc=1)
    for step in range(KEPT + 500):
        telemetry.add({"kind": "metrics", "rank": 0, "time": float(step), "step": step, "values": {"loss": 1.0}})
    kept = telemetry.metrics()
    assert len(kept) == KEPT and kept[-1]["step"] == KEPT + 499  # the newest


def test_a_memory_line_of_many_ranks_gives_their_range_and_the_rank_that_holds_most():
    from types import SimpleNamespace

    from nbshard.kernel.watching import RANKS_LISTED, memory_text

    def sample(rank, anon):
        return {"kind": "sample", "rank": rank, "time": 1.0, "rss": anon, "peak_rss": anon, "anon": anon, "peak_anon": anon}

    for nproc in (RANKS_LISTED, 32):
        telemetry = Telemetry(nproc)
        for rank in range(nproc):
            telemetry.add(sample(rank, (100 + (rank == 17) * 50 + rank % 3) * MIB))
        line = memory_text(SimpleNamespace(_telemetry=telemetry), peak=True)
        if nproc == RANKS_LISTED:
            assert line.count("rank ") == nproc and line.startswith("peak memory: rank 0 CPU anon 100.0 MiB, rank 1")
        else:
            assert line == "peak memory: 32 ranks CPU anon 100.0 MiB to 152.0 MiB (most: rank 17)"


def flood_metrics(count: int) -> int:
    for step in range(count):
        log_metrics(step=step, loss=float(step))
    return count


def test_each_ranks_last_sample_arrives_also_behind_a_flood_of_metrics():
    # 20,000 records a rank in a burst: the wire drops some, and its last sample (the peaks at
    # the end) used to be lost with them in about half the jobs. It is kept in a file as well.
    for _ in range(3):
        handle = nbshard.submit(flood_metrics, 20_000, nproc=2)
        assert handle.result() == 20_000
        assert len(handle.metrics()) == 40_000  # from the ranks' metrics files
        for rank in (0, 1):
            last_metric = max(m["time"] for m in handle.metrics() if m["rank"] == rank)
            samples = [r["time"] for r in handle.memory() if r["rank"] == rank]
            assert samples and max(samples) > last_metric, (rank, len(samples))
