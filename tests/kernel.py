"""A real IPython kernel driven through jupyter_client, as a notebook frontend drives it."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

from jupyter_client.manager import KernelManager

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class CellResult:
    status: str = ""
    stdout: str = ""
    stderr: str = ""
    error: dict[str, Any] | None = None
    reply: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def user_stdout(self) -> str:
        """stdout without nbshard's own notes (e.g. why a launch is cold)."""
        return "".join(line for line in self.stdout.splitlines(keepends=True) if not line.startswith("[nbshard]: "))

    @property
    def execution_count(self) -> int | None:
        """The number the notebook shows for this cell (``In [N]``)."""
        for message in self.messages:
            if message["msg_type"] == "execute_input":
                return message["content"]["execution_count"]
        return None

    def html(self, new_only: bool = False) -> list[str]:
        """The HTML of each display (``new_only``) or display and update of one, in order."""
        kinds = ("display_data",) if new_only else ("display_data", "update_display_data")
        return [m["content"]["data"]["text/html"] for m in self.messages
                if m["msg_type"] in kinds and "text/html" in m["content"].get("data", {})]

    @property
    def traceback(self) -> str:
        """The error as the notebook shows it, without colours."""
        return ANSI.sub("", "\n".join(self.error["traceback"])) if self.error else ""


def _record(result: CellResult, message: dict[str, Any]) -> None:
    """Add one IOPub message of the cell to ``result``."""
    result.messages.append(message)
    kind, content = message["msg_type"], message["content"]
    if kind == "stream":
        setattr(result, content["name"], getattr(result, content["name"]) + content["text"])
    elif kind == "error":
        result.error = content
    elif kind == "status" and content["execution_state"] == "idle":
        result.status = "error" if result.error else "ok"


class Kernel:
    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(cwd=str(cwd), env={**os.environ, **env})
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid  # type: ignore[union-attr]

    def submit(self, code: str) -> str:
        """Run a cell as a frontend that takes no input would (nbconvert): ``input()`` fails in it."""
        return self.client.execute(code, allow_stdin=False)

    def collect(self, msg_id: str, timeout: float = 120, until: str | tuple[str, ...] = ()) -> CellResult:
        """IOPub messages of one execution, until it is idle (or each of ``until`` appears in stdout)."""
        wanted = (until,) if isinstance(until, str) else until
        result = CellResult()
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"cell did not finish within {timeout} s; stdout so far:\n{result.stdout}")
            try:
                message = self.client.get_iopub_msg(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            _record(result, message)
            if result.status or (wanted and message["msg_type"] == "stream" and all(text in result.stdout for text in wanted)):
                return result

    def execute(self, code: str, timeout: float = 120) -> CellResult:
        """Run one cell to its end: its IOPub output and its execute_reply."""
        msg_id = self.submit(code)
        result = self.collect(msg_id, timeout)
        while True:
            reply = self.client.get_shell_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") == msg_id:
                result.reply = reply["content"]
                return result

    def execute_answering(self, code: str, answer: Callable[[str, str], str], timeout: float = 120) -> tuple[CellResult, list[str]]:
        """Run one cell that asks for input, as JupyterLab's input box answers: each
        ``input_request`` on the stdin channel gets ``answer(prompt, stdout so far)`` as its
        ``input_reply``. Returns the cell's result and the prompts, in order."""
        msg_id = self.client.execute(code, allow_stdin=True)
        result, prompts = CellResult(), []
        deadline = time.monotonic() + timeout
        while not result.status:
            if time.monotonic() > deadline:
                raise TimeoutError(f"cell did not finish within {timeout} s; prompts {prompts}; stdout so far:\n{result.stdout}")
            with contextlib.suppress(queue.Empty):
                request = self.client.get_stdin_msg(timeout=0.02)
                if request["msg_type"] == "input_request" and request["parent_header"].get("msg_id") == msg_id:
                    self._drain_iopub(msg_id, result)  # what the cell showed before it asked
                    prompts.append(request["content"]["prompt"])
                    self.client.input(answer(request["content"]["prompt"], result.stdout))
            self._drain_iopub(msg_id, result)
        return result, prompts

    def _drain_iopub(self, msg_id: str, result: CellResult) -> None:
        while True:
            try:
                message = self.client.get_iopub_msg(timeout=0.05)
            except queue.Empty:
                return
            if message["parent_header"].get("msg_id") == msg_id:
                _record(result, message)
                if result.status:
                    return

    @staticmethod
    def assert_reads_as_a_local_error(result: CellResult) -> None:
        """The cell's error shows the rank's traceback and nbshard's summary, with none of
        nbshard's frames and no escaped ``run_cell_magic`` call around them."""
        text = result.traceback
        for plumbing in ("nbshard/", "run_cell_magic", "get_ipython()", "The above exception was the direct cause"):
            assert plumbing not in text, text

    def assert_short_interrupt(self, result: CellResult, where: str, ranks: int = 2) -> None:
        """The interrupt ended the cell with a few lines saying where each rank was, in the
        user's terms, and none of nbshard's plumbing: no stack dumps, no nbshard frames."""
        assert result.error is not None and result.error["ename"] == "JobInterrupted", result.error
        text = result.traceback
        assert text.startswith("KeyboardInterrupt: "), text
        for rank in range(ranks):
            assert f"rank {rank} was stopped by nbshard at:" in text, text
        assert text.count(where) == ranks, text
        shown = result.stdout + result.stderr + text
        for plumbing in ("Thread 0x", "Current thread", "threading.py", "runpy", "worker.py", "handle.py", "client.py"):
            assert plumbing not in shown, shown
        assert len(text.splitlines()) <= 4 * ranks + 3, text

    def shutdown(self) -> None:
        self.client.stop_channels()
        if self.manager.is_alive():
            self.manager.shutdown_kernel(now=True)
