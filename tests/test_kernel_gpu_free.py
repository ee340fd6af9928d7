"""In a real kernel: the live view of a job, and a kernel that stays free of torch and GPUs."""

from __future__ import annotations

import pytest

from conftest import gpu_count

pytestmark = pytest.mark.timeout(180)

HOLD = '''
import nbshard

def hold(megabytes):
    import time
    time.sleep(0.4)
    block = bytearray(megabytes * 1024 * 1024)
    block[::4096] = b"x" * len(block[::4096])
    for step in range(4):
        nbshard.log_metrics(step=step, loss=1.0 / (step + 1))
        print(f"step {step}", flush=True)
        time.sleep(0.4)
    return len(block)
'''


def test_run_shows_a_live_view_that_ends_as_a_summary(kernel):
    assert kernel.execute(HOLD).status == "ok"
    result = kernel.execute("nbytes = nbshard.run(hold, 100, nproc=2, sample_interval=0.2)")
    assert result.status == "ok", result.traceback
    shown = [m for m in result.messages if m["msg_type"] in ("display_data", "update_display_data")]
    assert shown[0]["msg_type"] == "display_data"
    display_id = shown[0]["content"]["transient"]["display_id"]
    assert all(m["content"]["transient"]["display_id"] == display_id for m in shown)
    assert len(shown) <= 20, "updated at most about once a second"
    final = shown[-1]["content"]["data"]
    assert final["text/plain"].splitlines()[0].startswith("hold on 2 ranks: succeeded")
    for rank in (0, 1):
        assert f"rank {rank} | CPU " in final["text/plain"] and "loss=0.25 step=3" in final["text/plain"]
    assert "<svg" in final["text/html"] and "<script" not in final["text/html"]
    assert "[rank0]: step 3" in result.stdout  # the lines themselves still stream into the cell


def test_a_quick_silent_call_shows_one_view_and_a_printing_one_shows_it_above_its_lines(kernel):
    # Each display waits for the kernel's output thread: a call that ends before the view's first
    # update shows it once, at its end, not once at its start and again as its summary.
    setup = kernel.execute(
        "import nbshard, time\ns = nbshard.session('view', nproc=2, sample_interval=0.2)\n"
        "def quiet():\n    return 1\n"
        "def slow():\n    time.sleep(1.5)\n"
        "def loud():\n    print('hello', flush=True)\n    return 2\n"
        "s.run(quiet)"
    )
    assert setup.status == "ok", setup.traceback
    quick = kernel.execute("s.run(quiet)\ns.run(quiet)\ns.run(quiet)")
    assert quick.status == "ok", quick.traceback
    shown = [m for m in quick.messages if m["msg_type"] in ("display_data", "update_display_data")]
    assert [m["msg_type"] for m in shown] == ["display_data"] * 3
    assert all("succeeded" in m["content"]["data"]["text/plain"].splitlines()[0] for m in shown)
    # A memory chart of a moment (the samples of a call of milliseconds) would say less than the table.
    assert not any('aria-label="memory' in m["content"]["data"]["text/html"] for m in shown)
    printed = kernel.execute("s.run(loud)")
    assert printed.status == "ok", printed.traceback
    kinds = [m["msg_type"] for m in printed.messages if m["msg_type"] in ("display_data", "update_display_data", "stream")]
    assert kinds[0] == "display_data" and "stream" in kinds, kinds  # the view sits above the lines
    assert "[rank0]: hello" in printed.stdout and "[rank1]: hello" in printed.stdout
    assert "succeeded" in printed.html()[-1]
    slow = kernel.execute("s.run(slow)")  # its samples span more than a second: a chart says more now
    assert slow.status == "ok", slow.traceback
    assert 'aria-label="memory' in slow.html()[-1]
    kernel.execute("s.close()")


def test_a_whole_job_leaves_torch_unimported_in_the_kernel(kernel):
    assert kernel.execute(HOLD).status == "ok"
    result = kernel.execute(
        "import sys\n"
        "value = nbshard.run(hold, 10, nproc=2)\n"
        "print(value, nbshard.check_kernel(), sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning')))"
    )
    assert result.status == "ok", result.traceback
    assert result.stdout.strip().splitlines()[-1] == f"{10 * 1024 * 1024} None []"


def test_hiding_gpus_from_the_kernel_keeps_them_for_the_ranks(tmp_path, runs_dir, monkeypatch):
    from conftest import REPO, pythonpath
    from kernel import Kernel

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    kernel = Kernel(tmp_path, {"NBSHARD_RUNS_DIR": str(runs_dir), "PYTHONPATH": pythonpath(REPO)})
    try:
        result = kernel.execute(
            "import os, nbshard\n"
            "nbshard.hide_gpus_from_kernel()\n"
            "def visible():\n"
            "    import os\n"
            "    return os.environ.get('CUDA_VISIBLE_DEVICES')\n"
            "handle = nbshard.submit(visible, return_all=True)\n"
            "print(repr(os.environ['CUDA_VISIBLE_DEVICES']), handle.world_size, handle.result(timeout=60))"
        )
        assert result.status == "ok", result.traceback
        assert result.stdout.strip() == "'' 2 ['0,1', '0,1']"
    finally:
        kernel.shutdown()


@pytest.mark.gpu
def test_ranks_not_the_kernel_hold_device_memory(kernel):
    pytest.importorskip("pynvml", reason="needs nvidia-ml-py for the per-process device list")
    result = kernel.execute(
        "import os, nbshard, pynvml\n"
        "def use_gpu():\n"
        "    import os, time, torch\n"
        "    x = torch.ones(256, 1024, 1024, device=nbshard.device())  # 1 GiB\n"
        "    time.sleep(3)\n"
        "    return os.getpid()\n"
        "handle = nbshard.submit(use_gpu, nproc=1, sample_interval=0.2)\n"
        "import time\n"
        "while not handle.done() and not any((r['gpu_allocated'] or 0) >= 2**30 for r in handle.memory()):\n"
        "    time.sleep(0.1)  # a cold rank imports torch first: seconds with a CUDA build\n"
        "pynvml.nvmlInit()\n"
        "holders = {p.pid for i in range(pynvml.nvmlDeviceGetCount()) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i))}\n"
        "rank_pid = handle.result(timeout=120)\n"
        "print(rank_pid in holders, os.getpid() in holders, nbshard.check_kernel())\n"
        "print(max(r['gpu_allocated'] or 0 for r in handle.memory()) >= 2**30)"
    )
    assert result.status == "ok", result.traceback
    assert result.stdout.split() == ["True", "False", "None", "True"]


@pytest.mark.gpu
def test_a_kernel_with_a_cuda_context_is_warned_and_still_launches(kernel):
    assert gpu_count() > 0
    result = kernel.execute(
        "import warnings, torch, nbshard\n"
        "torch.zeros(1).cuda()\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    print(nbshard.run(lambda: 'ran', nproc=1))\n"
        "print(caught[0].category.__name__, 'restart the kernel' in str(caught[0].message))"
    )
    assert result.status == "ok", result.traceback
    assert result.stdout.split()[-3:] == ["ran", "KernelHoldsCUDA", "True"]
