"""What a person sees: a notebook run cell by cell in a real JupyterLab, in a real Chromium.

Each test looks at the page itself (the rendered outputs, what is in view),
not at the messages behind it. Screenshots of each step are kept in the
test's directory (or in ``$NBSHARD_SCREENSHOTS``) for a person to look at.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from conftest import REPO, pythonpath, wait_until_gone

pytestmark = pytest.mark.timeout(300)

playwright = pytest.importorskip("playwright.sync_api", reason="the browser tests need Playwright (pip install playwright)")

from browser import CHROMIUM, CHROMIUM_FLAGS, JupyterLab, NotebookPage, write_notebook  # noqa: E402

if CHROMIUM is None:
    pytest.skip("the browser tests need Chromium (apt-get install chromium)", allow_module_level=True)

CELLS = [
    "%load_ext nbshard\nimport nbshard",
    # 1: a progress bar on stderr, cleared before each log line on stdout, as tqdm does under a Trainer
    "%%shard_train --nproc 2 --show-ranks 0\n"
    "import sys, time\n"
    "for step in range(1, 301):\n"
    "    sys.stderr.write(f'\\rtraining {step}/300 |' + '#' * (step // 30))\n"
    "    sys.stderr.flush()\n"
    "    if step % 100 == 50:\n"
    "        sys.stderr.write('\\r' + ' ' * 40 + '\\r')\n"
    "        sys.stderr.flush()\n"
    "        print(f'logged step {step}', flush=True)\n"
    "    time.sleep(0.004)\n"
    "sys.stderr.write('\\n')\n"
    "sys.stderr.write('\\rcleaning up' + '\\r' + ' ' * 12 + '\\r\\n')  # a bar cleared, then ended\n",
    # 2: a rank fails
    "%%shard_train --nproc 2\n"
    "def check(value):\n"
    "    if value > 0:\n"
    "        raise ValueError(f'rank {value} diverged')\n"
    "check(rank)\n",
    # 3: a job in the background with its live view
    "%%shard_train --nproc 2 --noblock job\n"
    "import time\n"
    "for i in range(40):\n"
    "    print(f'line {i}', flush=True)\n"
    "    time.sleep(0.15)\n",
    # 4: a job the person stops with the stop button
    "import time\n"
    "def wait_long():\n"
    "    print('waiting', flush=True)\n"
    "    time.sleep(600)\n"
    "nbshard.run(wait_long, nproc=2)\n",
    # 5: a blocking cell that pulls a name back
    "%%shard_train --nproc 2 --pull total\ntotal = rank + 41\n",
    # 6: a session, closed: what its table shows of ranks that are gone
    "def hold():\n"
    "    global block\n"
    "    block = bytearray(64 * 2**20)\n"
    "shot = nbshard.session('shot', nproc=2)\n"
    "shot.run(hold)\n"
    "shot.close()\n"
    "shot",
    # 7: a job on 2 nodes whose memory stays steady, and a job with more lines than the view keeps
    "import time\n"
    "def steady():\n"
    "    for i in range(30):\n"
    "        print(f'step {i}', flush=True)\n"
    "        time.sleep(0.1)\n"
    "two_nodes = nbshard.submit(steady, nproc=1, nnodes=2, sample_interval=0.2)\n"
    "two_nodes.show_live()",
    # 8: a job that logs metrics, watched: its live view draws them, and its memory, as it runs
    "import os, time\n"
    "def train(steps):\n"
    "    for step in range(1, steps + 1):\n"
    "        rank = int(os.environ['RANK'])\n"
    "        nbshard.log_metrics(step=step, loss=2.0 / step ** 0.5 + 0.05 * rank, tokens_per_s=1000 + 10 * step + 50 * rank)\n"
    "        time.sleep(0.1)\n"
    "trained = nbshard.submit(train, 40, nproc=2, sample_interval=0.2)\n"
    "trained.watch()",
    # 9: the same job's charts, drawn larger
    "trained.plot()",
    # 10: a cell profiled in every rank
    "%%shard_train --nproc 2 --profile\n"
    "import torch, torch.distributed as dist\n"
    "dist.init_process_group('gloo')\n"
    "x = torch.randn(128, 128)\n"
    "for _ in range(10):\n"
    "    x = torch.tanh(x @ x)\n"
    "    dist.all_reduce(x)\n",
    # 11: rank 1 stops at a breakpoint; the cell asks for pdb's commands in its input box
    "def step_through(steps):\n"
    "    import torch, torch.distributed as dist\n"
    "    dist.init_process_group('gloo')\n"
    "    loss = 0.0\n"
    "    for step in range(steps):\n"
    "        loss += 1.0 / (step + 1)\n"
    "        if step == 1:\n"
    "            breakpoint()\n"
    "    dist.all_reduce(torch.tensor([loss]))\n"
    "    return round(loss, 4)\n"
    "nbshard.run(step_through, 3, nproc=2, debug_ranks=[1])",
    # 12-15: a session's call fails in rank 1, and is debugged post-mortem
    "pm = nbshard.session('pm', nproc=2)",
    "%%shard_train --session pm\nweights = [rank * 10 + i for i in range(3)]\nfactor = 1 / (rank - 1)\n",
    "%shard_debug --session pm",
    "pm.close()",
]


@pytest.fixture(scope="module")
def notebook(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lab")
    shots = Path(os.environ.get("NBSHARD_SCREENSHOTS") or root / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    runs = root / "runs"
    write_notebook(root / "person.ipynb", CELLS)
    lab = JupyterLab(root, {"NBSHARD_RUNS_DIR": str(runs), "PYTHONPATH": pythonpath(REPO)})
    try:
        with playwright.sync_playwright() as driver:
            browser = driver.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
            try:
                page = NotebookPage(browser.new_page(), lab, "person.ipynb", shots)
                assert page.run(0) == 1
                yield page
            finally:
                browser.close()
    finally:
        lab.stop()
        assert not wait_until_gone(runs, within=5.0), "a rank or launcher outlived JupyterLab"


def stdout_lines(page: NotebookPage, index: int) -> list[str]:
    return page.text(index, "application/vnd.jupyter.stdout").splitlines()


def test_a_progress_bar_is_one_line_below_the_logs(notebook):
    notebook.run(1)
    notebook.screenshot("1-progress-bar", of=1)
    lines = [line.rstrip() for line in stdout_lines(notebook, 1)]
    assert [line for line in lines if "logged" in line] == [f"[rank0]: logged step {s}" for s in (50, 150, 250)]
    bars = [line for line in lines if "training" in line]
    assert bars == ["[rank0]: training 300/300 |##########"], lines
    assert "[rank0]:" not in lines and "" not in lines  # no empty prefixed lines, no blank leftovers
    assert len(notebook.outputs(1, "text/html")) == 1  # the live view: one output, updated in place


def test_a_failing_rank_reads_as_a_local_error_with_the_cells_number(notebook):
    number = notebook.run(2)
    notebook.screenshot("2-failing-rank", of=2)
    error = notebook.text(2, "application/vnd.jupyter.stderr")
    assert f"Cell In[{number}], line 5" in error and f"Cell In[{number}], line 4, in check" in error
    assert "ValueError: rank 1 diverged" in error and "JobFailed: The job failed on rank 1." in error
    assert "nbshard/" not in error and "run_cell_magic" not in error and "get_ipython()" not in error
    # The rank's traceback is shown once, as the notebook's own, not also as streamed lines.
    assert "Traceback" not in notebook.text(2, "application/vnd.jupyter.stdout")


def test_the_live_view_updates_in_place_with_the_newest_line_in_view(notebook):
    notebook.run(3)
    view = notebook.cell(3).locator(".nbshard-job")
    seen = []

    def newest() -> int:
        numbers = [int(n) for n in re.findall(r"line (\d+)", view.locator("pre").inner_text())] if view.locator("pre").count() else []
        return max(numbers, default=-1)

    notebook.wait_for(lambda: newest() >= 10, timeout=60)
    notebook.screenshot("3-live-view-running", of=3)
    scroller = notebook.page.locator(".jp-NotebookPanel .jp-WindowedPanel-outer")
    while "succeeded" not in view.inner_text():
        assert len(notebook.outputs(3, "text/html")) == 1  # updated in place, never appended
        tail = view.locator("pre")
        # The newest line is the last one shown, and the tail is not a box that scrolls.
        shown = tail.evaluate("e => [e.innerText, e.scrollHeight <= e.clientHeight + 1]")
        seen.append(max(int(n) for n in re.findall(r"line (\d+)", shown[0])))
        assert shown[0].rstrip().splitlines()[-1].endswith(f"line {seen[-1]}") and shown[1], shown
        # Updates leave the reader's place alone: the notebook does not scroll by itself.
        place = scroller.evaluate("e => e.scrollTop")
        notebook.page.wait_for_timeout(400)
        assert scroller.evaluate("e => e.scrollTop") == place
        assert len(seen) < 100, "the job did not end"
    notebook.screenshot("3-live-view-ended", of=3)
    assert seen == sorted(seen) and len(set(seen)) >= 3  # it moved on while watched
    assert newest() == 39


def test_the_stop_button_ends_a_job_with_a_short_message(notebook):
    notebook.run(4, wait=False)
    notebook.wait_for(lambda: stdout_lines(notebook, 4).count("[rank0]: waiting") + stdout_lines(notebook, 4).count("[rank1]: waiting") == 2)
    notebook.interrupt()
    notebook.wait_for(lambda: notebook.prompt(4) not in ("*", ""), timeout=30)
    number = int(notebook.prompt(4))
    notebook.screenshot("4-stopped", of=4)
    error = notebook.text(4, "application/vnd.jupyter.stderr")
    assert error.startswith("KeyboardInterrupt: wait_long was interrupted, and its ranks were stopped."), error
    assert error.count(f"Cell In[{number}], line 4, in wait_long") == 2 and error.count("time.sleep(600)") == 2
    assert len(error.splitlines()) <= 12
    shown = notebook.text(4)
    for plumbing in ("Thread 0x", "threading.py", "runpy", "nbshard/"):
        assert plumbing not in shown


def test_a_blocking_pull_says_what_it_bound(notebook):
    notebook.run(5)
    notebook.screenshot("5-pulled", of=5)
    assert "[nbshard]: pulled total into the notebook (rank 0's)" in stdout_lines(notebook, 5)


def test_a_closed_sessions_table_shows_its_ranks_gone(notebook):
    notebook.run(6, timeout=180)
    notebook.screenshot("6-closed-session", of=6)
    table = notebook.cell(6).locator(".nbshard-job").last  # the session itself, after its call's view
    text = table.inner_text()
    assert "session 'shot' on 2 ranks: closed" in text and text.count("gone") == 2, text
    assert "MiB" in text  # the peaks stay


def test_a_steady_job_on_two_nodes_reads_as_such(notebook):
    notebook.run(7)
    view = notebook.cell(7).locator(".nbshard-job")
    notebook.wait_for(lambda: "succeeded" in view.inner_text(), timeout=120)
    notebook.screenshot("7-two-nodes-steady", of=7)
    text = view.inner_text()
    assert "steady on 2 ranks (2 nodes x 1): succeeded" in text, text
    assert "earlier lines not shown here; handle.logs(rank) has every line" in text  # 60 lines, 20 shown
    lines = view.locator("table polyline")  # the sparklines (the charts below the table have their own)
    assert lines.count() == 2
    styles = [lines.nth(i).get_attribute("stroke-dasharray") for i in range(2)]
    titles = [view.locator("table svg title").nth(i).text_content() for i in range(2)]
    # A rank's memory that barely moves is drawn dashed (steady), one that moves is drawn solid.
    assert all((style is not None) == title.startswith("steady") for style, title in zip(styles, titles)), (styles, titles)


def test_a_jobs_metrics_and_memory_are_drawn_live_and_as_a_plot(notebook):
    notebook.run(8, wait=False)
    view = notebook.cell(8).locator(".nbshard-job")
    notebook.wait_for(lambda: view.count() and view.locator("svg[aria-label='loss']").count(), timeout=120)
    running = view.locator("svg[aria-label='loss'] polyline").first.get_attribute("points")
    notebook.screenshot("8-live-charts-running", of=8)
    assert "running" in view.inner_text()  # drawn while the job runs, not only at its end
    notebook.wait_for(lambda: notebook.prompt(8) not in ("*", ""), timeout=120)
    notebook.screenshot("8-live-charts-done", of=8)
    assert len(notebook.outputs(8, "text/html")) == 1  # one view, updated in place
    for label in ("loss", "tokens_per_s"):
        chart = view.locator(f"svg[aria-label='{label}']")
        assert chart.count() == 1 and chart.locator("polyline").count() == 2, label  # a line per rank
    assert view.locator("svg[aria-label*='memory']").count() == 1
    assert view.locator("svg[aria-label='loss'] polyline").first.get_attribute("points") != running  # it grew

    notebook.run(9)
    plot = notebook.cell(9).locator(".nbshard-plot")
    notebook.screenshot("9-plot", of=9)
    labels = [svg.get_attribute("aria-label") for svg in plot.locator("svg").all()]
    assert labels[1:] == ["loss", "tokens_per_s"] and "memory" in labels[0], labels
    assert "succeeded" in plot.inner_text() and "rank 1" in plot.inner_text()


def test_a_profiled_cell_shows_each_ranks_top_operators_and_trace(notebook):
    notebook.run(10, timeout=180)
    report = notebook.cell(10).locator(".nbshard-profile")
    notebook.wait_for(lambda: report.count() == 1, timeout=30)
    report.scroll_into_view_if_needed()
    notebook.screenshot("10-profile")
    text = report.inner_text()
    assert "rank 0" in text and "rank 1" in text and "communication" in text, text
    assert "aten::mm" in text and "c10d::allreduce_" in text and ".pt.trace.json" in text, text


def answer(notebook: NotebookPage, index: int, line: str, then_shows: str) -> None:
    """Type ``line`` into the cell's input box and press Enter, as a person does; wait until
    the cell shows ``then_shows``."""
    box = notebook.cell(index).locator(".jp-Stdin-input")
    notebook.wait_for(lambda: box.count() >= 1, timeout=120)
    box.last.fill(line)  # an answered box may linger for a moment beside the new one
    box.last.press("Enter")
    notebook.wait_for(lambda: then_shows in notebook.text(index), timeout=60)


def test_a_ranks_breakpoint_is_answered_in_the_cells_input_box(notebook):
    notebook.run(11, wait=False)
    box = notebook.cell(11).locator(".jp-Stdin-input")
    notebook.wait_for(lambda: box.count() == 1, timeout=120)
    notebook.screenshot("11-debugger-prompt", of=11)
    assert notebook.cell(11).locator(".jp-Stdin-prompt").inner_text().strip() == "(Pdb rank 1)"
    text = notebook.text(11)
    assert "rank 1 stopped in the debugger; where the other ranks are:" in text and "inside all_reduce" in text, text
    assert "rank 1 paused in the debugger" in text and "handle.watch() answers" not in text, text  # this cell asks
    assert "dist.all_reduce(torch.tensor([loss]))" in text and "-> for step in range(steps):" in text, text
    answer(notebook, 11, "p loss", "\n1.5")
    notebook.screenshot("11-debugger-answered", of=11)
    answer(notebook, 11, "c", "1.8333")
    notebook.wait_for(lambda: notebook.prompt(11) not in ("*", ""), timeout=60)
    assert "1.8333" in notebook.text(11, "text/plain")  # rank 0's value, as if nobody had stopped


def test_a_failed_session_call_is_debugged_post_mortem(notebook):
    notebook.run(12, timeout=120)
    notebook.run(13, timeout=120)
    assert "ZeroDivisionError" in notebook.text(13, "application/vnd.jupyter.stderr")
    notebook.run(14, wait=False)
    answer(notebook, 14, "p weights, rank", "([10, 11, 12], 1)")
    answer(notebook, 14, "where", "-> factor = 1 / (rank - 1)")
    box = notebook.cell(14).locator(".jp-Stdin-input")
    notebook.wait_for(lambda: box.count() >= 1, timeout=60)
    notebook.screenshot("14-post-mortem", of=14)
    assert "where the other ranks are" not in notebook.text(14)  # a post-mortem holds nobody up
    box.last.fill("q")
    box.last.press("Enter")
    notebook.wait_for(lambda: notebook.prompt(14) not in ("*", ""), timeout=60)
    assert not notebook.text(14, "application/vnd.jupyter.stderr")
    notebook.run(15, timeout=60)
