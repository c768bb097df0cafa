"""Headless Chromium driven through its DevTools protocol over a pipe
(``--remote-debugging-pipe``: JSON messages ended by a NUL byte on file
descriptors 3 and 4), with the standard library alone: no websocket client
or browser automation package is needed. Used by the viewer's browser tests,
``bench/bench_view.py`` and ``docs/make_view_shots.py``.

Install the browser with ``apt-get install chromium`` (Debian / Ubuntu).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

INSTALL_HINT = "no Chromium found: install it with `apt-get install chromium` (Debian/Ubuntu)"


def chromium() -> str | None:
    """The Chromium (or Chrome) executable on PATH, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if path := shutil.which(name):
            return path
    return None


# (A copy made by os.dup may itself be 3 or 4, where dup2 leaves it closed
# on exec: hence set_inheritable.)
_LAUNCHER = ("import os, sys; r, w = os.dup(int(sys.argv[1])), os.dup(int(sys.argv[2])); "
             "os.dup2(r, 3); os.dup2(w, 4); os.set_inheritable(3, True); "
             "os.set_inheritable(4, True); os.execv(sys.argv[3], sys.argv[3:])")


class BrowserError(RuntimeError):
    """A DevTools command failed, or a page's script threw."""


class Browser:
    """One headless Chromium process with one page.

    Arguments:
        width, height: the page's viewport in CSS pixels.
        executable: the browser (``chromium()`` by default).
    """

    def __init__(self, width: int = 1400, height: int = 900, executable: str | None = None):
        exe = executable or chromium()
        if exe is None:
            raise FileNotFoundError(INSTALL_HINT)
        self._profile = tempfile.mkdtemp(prefix="taxpr-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        # A small launcher puts the pipe's ends at the browser's descriptors
        # 3 and 4 and becomes the browser (no preexec_fn: forking this
        # multithreaded process, which JAX warns of, is not needed).
        args = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                f"--user-data-dir={self._profile}", "about:blank"]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, str(to_browser_r), str(from_browser_w), *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(to_browser_r, from_browser_w))
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []
        self.errors: list[str] = []  # exceptions thrown by a page's scripts
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self._page_id = self.send("Target.attachToTarget", targetId=target,
                                  flatten=True)["sessionId"]
        for domain in ("Page", "Runtime"):
            self.send(f"{domain}.enable", to_page=True)
        self.send("Emulation.setDeviceMetricsOverride", to_page=True, width=width,
                  height=height, deviceScaleFactor=1, mobile=False)

    # ---- the protocol
    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("no message from Chromium")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise BrowserError("Chromium closed its pipe")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method: str, to_page: bool = False, timeout: float = 60, **params) -> dict:
        """Send one DevTools command (to the page if ``to_page``) and wait
        for its answer; events arriving meanwhile are kept in ``events``."""
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if to_page:
            msg["sessionId"] = self._page_id
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read(timeout)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if reply.get("method") == "Runtime.exceptionThrown":
                self.errors.append(json.dumps(reply["params"]["exceptionDetails"])[:2000])
            self.events.append(reply)

    def wait_event(self, method: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for i, ev in enumerate(self.events):
                if ev.get("method") == method:
                    return self.events.pop(i)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {method} from Chromium")
            ev = self._read(deadline - time.monotonic())
            if ev.get("method") == "Runtime.exceptionThrown":
                self.errors.append(json.dumps(ev["params"]["exceptionDetails"])[:2000])
            self.events.append(ev)

    # ---- pages
    def open(self, path: str | os.PathLike, timeout: float = 120) -> float:
        """Load a file and wait for its load event.

        Returns:
            Seconds from the navigation to the load event (the browser's
            own clock: ``performance.timing``).
        """
        self.events.clear()
        self.send("Page.navigate", to_page=True, url=Path(path).resolve().as_uri())
        self.wait_event("Page.loadEventFired", timeout)
        ms = self.eval("performance.timing.loadEventStart - performance.timing.navigationStart")
        return ms / 1000

    def eval(self, expression: str, timeout: float = 60) -> Any:
        """Evaluate JavaScript in the page; the value (JSON-able) it returns."""
        reply = self.send("Runtime.evaluate", to_page=True, timeout=timeout,
                          expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in reply:
            raise BrowserError(json.dumps(reply["exceptionDetails"])[:2000])
        return reply["result"].get("value")

    def click(self, selector: str) -> None:
        """Click the first element matching a CSS selector (a DOM click)."""
        found = self.eval(f"(() => {{ const el = document.querySelector({json.dumps(selector)});"
                          f" if (!el) return false; el.click(); return true; }})()")
        if not found:
            raise BrowserError(f"no element matches {selector!r}")

    def screenshot(self, path: str | os.PathLike) -> None:
        """Write the viewport as a PNG file."""
        data = self.send("Page.captureScreenshot", to_page=True, format="png")["data"]
        Path(path).write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except (BrowserError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
