"""A real headless Chromium driven over its DevTools protocol (a websocket, with aiohttp): no
browser-automation dependency. ``Browser`` starts Debian's ``chromium`` in its own profile dir
and process group, and ends the whole group (its zygote, GPU and renderer processes) on close.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self) -> None:
        self.profile = Path(tempfile.mkdtemp(prefix="fo-chromium-"))
        self.proc: subprocess.Popen | None = None
        self.session: aiohttp.ClientSession | None = None
        self.ws = None
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future] = {}
        self.events: list[dict] = []
        self._reader: asyncio.Task | None = None

    async def start(self, timeout: float = 30.0) -> None:
        assert CHROMIUM, "chromium is not installed (apt-get install chromium)"
        args = [CHROMIUM, "--headless", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
                "--disable-extensions", "--disable-background-networking", "--disable-dev-shm-usage",
                "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}", "--window-size=1280,900", "about:blank"]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses to run its sandbox as root
        # its temp dir is the profile's: Chromium leaves its singleton socket's dir in TMPDIR
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, env=os.environ | {"TMPDIR": str(self.profile)})
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start (exit {self.proc.poll()})")
            await asyncio.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        self.session = aiohttp.ClientSession()
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as r:
            pages = [t for t in await r.json() if t["type"] == "page"]
        self.ws = await self.session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=64 << 20)
        self._reader = asyncio.ensure_future(self._read())
        await self.send("Page.enable")
        await self.send("Network.enable")
        await self.send("Runtime.enable")
        await self.send("Emulation.setDeviceMetricsOverride", width=1280, height=900, deviceScaleFactor=1,
                        mobile=False)  # the headless window's viewport is smaller than its size

    async def _read(self) -> None:
        async for msg in self.ws:
            data = json.loads(msg.data)
            if "id" in data:
                fut = self._replies.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
            else:
                self.events.append(data)

    async def send(self, method: str, **params) -> dict:
        i = next(self._ids)
        fut = self._replies[i] = asyncio.get_running_loop().create_future()
        await self.ws.send_json({"id": i, "method": method, "params": params})
        reply = await asyncio.wait_for(fut, 30)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    async def navigate(self, url: str, timeout: float = 15.0) -> int:
        """Load ``url``; returns the HTTP status of the main document once the page has loaded."""
        self.events.clear()
        result = await self.send("Page.navigate", url=url)
        frame = result["frameId"]
        return await self.wait_document(frame, timeout)

    async def wait_document(self, frame: str | None = None, timeout: float = 15.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            loaded = any(e["method"] == "Page.loadEventFired" for e in self.events)
            docs = [e["params"]["response"]["status"] for e in self.events
                    if e["method"] == "Network.responseReceived" and e["params"].get("type") == "Document"
                    and (frame is None or e["params"].get("frameId") == frame)]
            if loaded and docs:
                return docs[-1]
            await asyncio.sleep(0.02)
        raise AssertionError(f"page did not load within {timeout} s")

    async def eval(self, expression: str):
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self, path: Path) -> bytes:
        data = base64.b64decode((await self.send("Page.captureScreenshot", format="png"))["data"])
        path.write_bytes(data)
        return data

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self.ws is not None:
            await self.ws.close()
        if self.session is not None:
            await self.session.close()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.proc is not None:
            try:  # the renderers and the zygote of Chromium: the whole group, whatever is left
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)
