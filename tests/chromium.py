"""Headless Chromium driven over the Chrome DevTools Protocol with aiohttp: no driver, no download.

Debian's `chromium` is started with `--remote-debugging-port=0`; it writes the port it chose to
`DevToolsActivePort` in its profile folder. A page target is opened through the `/json/new` endpoint
and driven over its websocket: `Page.navigate`, `Runtime.evaluate`, `Page.captureScreenshot`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Self

import aiohttp
import pytest

CHROMIUM_CANDIDATES = ("chromium", "chromium-browser")


def chromium_binary() -> str:
    """Debian's chromium; a missing browser is a failure with the fix in the message, never a skip."""
    for name in CHROMIUM_CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    pytest.fail(
        "chromium is not installed, and the browser test needs it: run `apt-get install -y chromium` "
        "(`.ci/run` installs it when missing)",
        pytrace=False,
    )


class CdpError(RuntimeError):
    """The browser answered a command with an error, or not in time."""


class Chromium:
    """One headless browser process with one page, for one test."""

    def __init__(self, profile: Path, width: int = 1280, height: int = 800, timeout: float = 30) -> None:
        self.profile = profile
        self.width, self.height = width, height
        self.timeout = timeout
        self.process: subprocess.Popen[bytes] | None = None
        self.session: aiohttp.ClientSession | None = None
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.events: list[dict[str, Any]] = []
        self.reader: asyncio.Task[None] | None = None
        self.log_path = profile / "chromium.log"

    def _launch(self) -> None:
        binary = chromium_binary()
        self.profile.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    binary,
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-quic",
                    "--no-first-run",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                    f"--user-data-dir={self.profile}",
                    "--remote-debugging-port=0",
                    f"--window-size={self.width},{self.height}",
                    "about:blank",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    async def __aenter__(self) -> Self:
        self._launch()
        try:
            port = await self._devtools_port()
            self.session = aiohttp.ClientSession()
            async with self.session.put(f"http://127.0.0.1:{port}/json/new?about:blank") as response:
                target = await response.json(content_type=None)
            self.ws = await self.session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
            self.reader = asyncio.ensure_future(self._read())
            await self.send("Page.enable")
            await self.send("Runtime.enable")
            await self.send("Network.enable")
            await self.send(
                "Emulation.setDeviceMetricsOverride",
                {"width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False},
            )
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.reader
        if self.ws is not None:
            await self.ws.close()
        if self.session is not None:
            await self.session.close()
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)

    async def _devtools_port(self) -> int:
        """The port Chromium chose, from the first line of DevToolsActivePort in its profile."""
        marker = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise CdpError(f"chromium exited with {self.process.returncode}: {self._log_tail()}")
            if marker.exists():
                first = marker.read_text().splitlines()[:1]
                if first and first[0].isdigit():
                    return int(first[0])
            await asyncio.sleep(0.05)
        raise CdpError(f"chromium wrote no DevToolsActivePort within {self.timeout}s: {self._log_tail()}")

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""

    async def _read(self) -> None:
        assert self.ws is not None
        async for message in self.ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(message.data)
            future = self.pending.pop(data.get("id", -1), None)
            if future is not None and not future.done():
                future.set_result(data)
            elif "method" in data:
                self.events.append(data)
        for future in self.pending.values():
            if not future.done():
                future.set_exception(CdpError("the DevTools connection closed"))

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        assert self.ws is not None
        call_id = next(self.ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[call_id] = future
        await self.ws.send_json({"id": call_id, "method": method, "params": params or {}})
        try:
            answer = await asyncio.wait_for(future, self.timeout)
        except TimeoutError:
            raise CdpError(f"{method}: no answer within {self.timeout}s") from None
        if "error" in answer:
            raise CdpError(f"{method}: {answer['error']}")
        return answer["result"]

    async def navigate(self, url: str) -> None:
        result = await self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise CdpError(f"navigating to {url}: {result['errorText']}")

    async def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page (promises are awaited)."""
        result = await self.send(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True}
        )
        if "exceptionDetails" in result:
            raise CdpError(f"{expression[:80]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self, path: Path) -> Path:
        result = await self.send("Page.captureScreenshot", {"format": "png"})
        await asyncio.to_thread(path.write_bytes, base64.b64decode(result["data"]))
        return path

    def requested_urls(self) -> list[str]:
        """Every URL the page asked for since the start (Network.requestWillBeSent)."""
        return [
            e["params"]["request"]["url"] for e in self.events if e["method"] == "Network.requestWillBeSent"
        ]
