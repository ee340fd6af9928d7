"""A real JupyterLab server and a real Chromium driven by Playwright, as a person uses them.

The server runs on 127.0.0.1 with a token, its settings and workspaces in the
test's own directory; Chromium is Debian's (``/usr/bin/chromium``), started
headless with no network of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class JupyterLab:
    """``jupyter lab`` serving ``root``, stopped (with its kernels) by ``stop()``."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root = root
        self.port = free_port()
        self.token = secrets.token_hex(16)
        home = root / ".jupyter-home"
        for name in ("config", "data", "runtime", "settings", "workspaces"):
            (home / name).mkdir(parents=True, exist_ok=True)
        server_env = {
            **os.environ, **env,
            "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
            "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
        }
        # No news or update checks: this machine has no network, and a toast would cover the page.
        (home / "settings" / "@jupyterlab").mkdir(exist_ok=True)
        (home / "settings" / "@jupyterlab" / "apputils-extension").mkdir(exist_ok=True)
        (home / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings").write_text(
            json.dumps({"fetchNews": "false", "checkForUpdates": False})
        )
        # A kernel that stops answering says where its threads are: an IPython startup file (kernels
        # only) has faulthandler write every thread's stack to kernel_stacks on SIGUSR2.
        self.kernel_stacks = home / "kernel-stacks.txt"  # out of the notebook's file browser
        startup = home / "ipython" / "profile_default" / "startup"
        startup.mkdir(parents=True, exist_ok=True)
        (startup / "00-stacks-on-sigusr2.py").write_text(
            "import faulthandler, signal\n"
            f"faulthandler.register(signal.SIGUSR2, file=open({str(self.kernel_stacks)!r}, 'a'), all_threads=True)\n"
        )
        server_env["IPYTHONDIR"] = str(home / "ipython")
        self.log = open(root / "jupyterlab.log", "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
             f"--ServerApp.root_dir={root}", "--LabApp.news_url=", "--ServerApp.open_browser=False"],
            cwd=root, env=server_env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._wait_ready(timeout=90)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"jupyter lab exited: {(self.root / 'jupyterlab.log').read_text()}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(f"jupyter lab did not answer within {timeout} s")

    def kernel_stacks_now(self) -> str:
        """Every thread's Python stack in each of the server's kernels, as they are now."""
        kernels = []
        for entry in Path("/proc").iterdir():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == self.process.pid and b"ipykernel" in (entry / "cmdline").read_bytes():
                    kernels.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
        before = self.kernel_stacks.stat().st_size if self.kernel_stacks.exists() else 0
        for pid in kernels:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR2)
        time.sleep(1.0)
        stacks = self.kernel_stacks.read_bytes()[before:].decode(errors="replace") if self.kernel_stacks.exists() else ""
        return stacks or f"(no stacks written; kernels found: {kernels})"

    def stop(self) -> None:
        """Shut the server down, kernels included; SIGKILL its session if it lingers."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            self.process.send_signal(signal.SIGINT)  # the second one skips the "are you sure" prompt
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        self.log.close()


class NotebookPage:
    """One notebook open in JupyterLab in a Chromium page: run cells, read what they show."""

    def __init__(self, page: Any, lab: JupyterLab, notebook: str, shots: Path) -> None:
        self.page = page
        self.lab = lab
        self.shots = shots
        page.set_viewport_size({"width": 1400, "height": 1000})
        self.dialogs: list[str] = []  # what each dialog that came up unbidden said
        page.goto(f"{lab.url}/lab/tree/{notebook}?token={lab.token}")
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
        self._wait_for_kernel(lab, notebook, timeout=90)

    def _wait_for_kernel(self, lab: JupyterLab, notebook: str, timeout: float) -> None:
        """Until the server's kernel for ``notebook`` is idle and the page names it.

        The toolbar's execution indicator says idle before any kernel exists (its
        default), and a cell run while the page has no kernel yet opens JupyterLab's
        "Select Kernel" dialog over the notebook; so ask the server, then the page.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.handle_dialogs()
            with urllib.request.urlopen(f"{lab.url}/api/sessions?token={lab.token}", timeout=5) as answer:
                sessions = json.load(answer)
            idle = any(s["path"].endswith(notebook) and (s.get("kernel") or {}).get("execution_state") == "idle"
                       for s in sessions)
            named = self.page.locator(".jp-Toolbar-kernelName").first.inner_text().strip()
            if idle and named and named != "No Kernel":
                return
            self.page.wait_for_timeout(300)
        self.screenshot("no-kernel")
        raise TimeoutError(f"the notebook's kernel was not ready within {timeout} s; dialogs: {self.dialogs}")

    def handle_dialogs(self) -> None:
        """Answer a dialog that covers the notebook, keeping what it said in ``dialogs``.

        "Select Kernel" (the page ran a cell before its kernel was there) is answered
        with the default kernel, as a person would; any other is dismissed and the
        test that follows fails or passes on what the page then shows.
        """
        dialog = self.page.locator(".jp-Dialog")
        while dialog.count():
            said = " | ".join(dialog.first.inner_text().split("\n"))
            self.dialogs.append(said)
            self.screenshot(f"dialog-{len(self.dialogs)}")
            if "Select Kernel" in said:
                dialog.first.locator(".jp-mod-accept").click()
            else:
                self.page.keyboard.press("Escape")
            self.page.wait_for_timeout(300)
            if len(self.dialogs) > 20:
                raise RuntimeError(f"dialogs keep coming up over the notebook: {self.dialogs[-3:]}")

    def cell(self, index: int) -> Any:
        return self.page.locator(".jp-Notebook .jp-Cell").nth(index)

    def run(self, index: int, wait: bool = True, timeout: float = 120) -> int | None:
        """Select the cell and press Shift+Enter, as a person does; the number it is shown with.

        Right after the page loads, the kernel may not be connected yet and JupyterLab
        drops the request (the prompt stays blank): then the person presses again.
        A cell an earlier step left running (a kernel that hangs) fails this step at once,
        rather than every later step at its own timeout.
        """
        if any(self.prompt(other) == "*" for other in range(self.page.locator(".jp-Notebook .jp-Cell").count())):
            raise RuntimeError(f"an earlier step left a cell running, so the kernel cannot run cell {index}:\n"
                               f"{self._running_cells()}\nthe kernel's threads:\n{self.lab.kernel_stacks_now()}")
        for _ in range(5):
            self.handle_dialogs()
            self.cell(index).locator(".jp-InputArea-editor").click()
            self.page.keyboard.press("Shift+Enter")
            started = time.monotonic()
            while self.prompt(index) == "" and time.monotonic() - started < 5:
                self.page.wait_for_timeout(100)
            if self.prompt(index) != "":
                break
        if wait:
            self.wait_for(lambda: self.prompt(index) not in ("*", ""), timeout)
            return int(self.prompt(index))
        return None

    def prompt(self, index: int) -> str:
        """What the input prompt shows between the brackets: a number, "*" while running, or ""."""
        text = self.cell(index).locator(".jp-InputPrompt").inner_text().strip()
        return text.removeprefix("[").removesuffix("]:").strip()

    def _outputs(self, index: int, mime: str | None = None) -> Any:
        selector = ".jp-OutputArea-output" + (f"[data-mime-type='{mime}']" if mime else "")
        return self.cell(index).locator(selector)

    def outputs(self, index: int, mime: str | None = None) -> list[Any]:
        return self._outputs(index, mime).all()

    def text(self, index: int, mime: str | None = None) -> str:
        # One read of every output at once: JupyterLab may replace an output's element while the
        # cell runs (a stream appended to, an input box answered), and one listed first and read
        # after would be waited for in vain.
        return "\n".join(self._outputs(index, mime).all_inner_texts())

    def wait_for(self, condition: Any, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                self.screenshot("timed-out")
                shown = [" | ".join(d.inner_text().split("\n")) for d in self.page.locator(".jp-Dialog").all()]
                raise TimeoutError(f"the page did not get there within {timeout} s; dialogs: {self.dialogs + shown};"
                                   f" see {self.shots}\n{self._running_cells()}\nthe kernel's threads:\n{self.lab.kernel_stacks_now()}")
            self.page.wait_for_timeout(200)

    def _running_cells(self) -> str:
        """What each cell still marked as running shows (its last 30 lines)."""
        said = []
        for index in range(self.page.locator(".jp-Notebook .jp-Cell").count()):
            if self.prompt(index) == "*":
                shown = self.text(index).splitlines()[-30:]
                said.append(f"cell {index} is still running; it shows:\n" + "\n".join(f"  | {line}" for line in shown))
        return "\n".join(said) or "no cell is marked as running"

    def interrupt(self) -> None:
        """Click the toolbar's stop button (interrupt the kernel)."""
        self.page.locator("jp-button[data-command='notebook:interrupt-kernel']").click()

    def screenshot(self, name: str, of: int | None = None) -> Path:
        """The page as it is in view; with ``of``, scrolled so that cell's last output is in view."""
        if of is not None:
            self.cell(of).locator(".jp-OutputArea-output").last.scroll_into_view_if_needed()
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=False)
        return path


def write_notebook(path: Path, cells: list[str]) -> None:
    path.write_text(json.dumps({
        "cells": [
            {"cell_type": "code", "execution_count": None, "id": f"cell-{i}", "metadata": {}, "outputs": [], "source": src}
            for i, src in enumerate(cells)
        ],
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
        "nbformat": 4, "nbformat_minor": 5,
    }))
