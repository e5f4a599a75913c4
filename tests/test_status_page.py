"""The status page: who gets in (token, cookie), what it pushes, and a real Chromium watching a
`failover up` node while its primary is killed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import struct
import time

import aiohttp
import pytest

from browser_helpers import CHROMIUM, Browser
from conftest import free_port
from router_helpers import running_router, tolerant
from supervisor_helpers import Load, Node, wait_until

pytestmark = pytest.mark.asyncio
TOKEN = "status-page-token"


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "admin.token"
    path.write_text(TOKEN + "\n")
    os.chmod(path, 0o600)
    return tolerant(admin_token_file=path)


def _nothing_listens() -> str:
    return f"http://127.0.0.1:{free_port()}"


async def _sse_documents(resp: aiohttp.ClientResponse):
    """The ``data:`` documents of a server-sent event stream, as they come."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    yield json.loads(line[6:])


async def test_the_page_and_its_data_refuse_a_visitor_without_the_token(config):
    async with running_router(config, primary=_nothing_listens(), standbys=[_nothing_listens()]) as router:
        async with aiohttp.ClientSession() as s:
            async with s.get(router.url + "/status") as r:
                body = await r.text()
                assert r.status == 401 and 'action="/status/login"' in body and "instances" not in body
            for path in ("/status/doc", "/status/events"):
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Cookie": "failover_status=" + TOKEN}):
                    async with s.get(router.url + path, headers=headers) as r:
                        assert r.status == 401, (path, headers)
            async with s.post(router.url + "/status/login", data={"token": "wrong"}) as r:
                assert r.status == 401 and "Wrong token" in await r.text()
            async with s.get(router.url + "/", allow_redirects=False) as r:
                assert r.status == 303 and r.headers["Location"] == "/status"
            async with s.get(router.url + "/status/status.js") as r:  # assets carry no data
                assert r.status == 200 and r.content_type == "text/javascript"


async def test_login_sets_a_strict_httponly_cookie_that_opens_only_the_page(config):
    async with running_router(config, primary=_nothing_listens()) as router:
        # unsafe: aiohttp's jar otherwise keeps no cookie of an IP address (a browser does)
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
            async with s.post(router.url + "/status/login", data={"token": TOKEN}, allow_redirects=False) as r:
                assert r.status == 303 and r.headers["Location"] == "/status"
                cookie = r.headers["Set-Cookie"]
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
            async with s.get(router.url + "/status") as r:
                assert r.status == 200 and "/status/status.js" in await r.text()
                assert "default-src 'none'" in r.headers["Content-Security-Policy"]
            async with s.get(router.url + "/status/doc") as r:
                doc = await r.json()
                assert r.status == 200 and doc["services"][0]["primary"] == "primary-0"
            async with s.get(router.url + "/admin/status") as r:  # the cookie is not an admin credential
                assert r.status == 401
        async with aiohttp.ClientSession() as s:  # the bearer header works alone (curl)
            async with s.get(router.url + "/status/doc", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                assert r.status == 200


async def test_page_is_disabled_without_a_token_file():
    async with running_router(tolerant(), primary=_nothing_listens()) as router:
        async with aiohttp.ClientSession() as s:
            async with s.get(router.url + "/status") as r:
                assert r.status == 403 and "--admin-token-file" in await r.text()
            async with s.post(router.url + "/status/login", data={"token": ""}) as r:
                assert r.status == 403


async def test_events_push_a_role_change_at_once_and_end_with_the_router(config):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with running_router(config, primary=_nothing_listens(), standbys=[_nothing_listens()]) as router:
        interval = router.status_page.interval = 60.0  # any document after the first is a pushed change
        async with aiohttp.ClientSession() as s:
            async with s.get(router.url + "/status/events", headers=auth) as r:
                assert r.status == 200 and r.content_type == "text/event-stream"
                docs = _sse_documents(r)
                first = await anext(docs)
                roles = {i["name"]: i["role"] for i in first["services"][0]["instances"]}
                assert roles == {"primary-0": "primary", "standby-0": "standby"}
                t0 = time.monotonic()
                router.remove_instance("standby-0")
                pushed = await asyncio.wait_for(anext(docs), 5)
                assert time.monotonic() - t0 < interval / 2
                assert [i["name"] for i in pushed["services"][0]["instances"]] == ["primary-0"]
                stopping = asyncio.ensure_future(router.stop())
                t1 = time.monotonic()
                await asyncio.wait_for(stopping, 10)
                # the open stream did not hold the shutdown up to its timeout
                assert time.monotonic() - t1 < router.config.shutdown_timeout


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def node(procs, tiny_model, run_dir):
    n = Node(procs, tiny_model, run_dir)
    yield n
    n.stop()


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium")
async def test_chromium_sees_a_kill_of_the_primary_as_a_role_change_within_a_second(node, tmp_path):
    primary, standby = await asyncio.to_thread(wait_until, node.serving_pair, 30, "a ready primary and standby")
    browser = Browser()
    try:
        await browser.start()
        # no token: refused, the login form and nothing of the node
        assert await browser.navigate(node.url + "/status") == 401
        assert await browser.eval("document.querySelector('[data-instance]') === null")
        assert await browser.eval("!!document.querySelector('form#login input[name=token]')")
        # log in through the form, as a person would
        browser.events.clear()
        await browser.eval(f"document.getElementById('token').value = {json.dumps(node.token)};"
                           "document.getElementById('login').submit(); true")
        assert await browser.wait_document() == 200
        role_of = "(n => { const r = document.querySelector(`[data-instance='${n}']`); return r && r.dataset.role; })"
        await _until(browser, f"{role_of}({json.dumps(primary['name'])}) === 'primary'", 10)
        assert await browser.eval(f"{role_of}({json.dumps(standby['name'])})") == "standby"
        assert "ready (weights resident)" in await browser.eval("document.getElementById('node-table').innerText")
        shot = await browser.screenshot(tmp_path / "status-before.png")
        assert _png_size(shot) == (1280, 900) and len(shot) > 10_000  # a rendered page, not a blank one

        os.kill(primary["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        await _until(browser, f"{role_of}({json.dumps(standby['name'])}) === 'primary' && "
                     f"{role_of}({json.dumps(primary['name'])}) !== 'primary'", 5)
        seen = time.monotonic() - t0
        assert seen < 1.0, f"the page showed the switch {seen * 1e3:.0f} ms after the kill"

        # traffic completes the failover's record; the relaunched instance comes back as standby
        load = Load(node.url, workers=1)
        load.start()
        try:
            await _until(browser, f"{role_of}({json.dumps(primary['name'])}) === 'standby'", 30)
            row = f"document.querySelector(`#timeline tr[data-old='{primary['name']}']`)"
            await _until(browser, f"{row} && !{row}.innerText.includes('\\t-\\t')", 30)
        finally:
            await asyncio.to_thread(load.stop)
        cells = await browser.eval(f"[...{row}.cells].map(c => c.innerText)")
        assert cells[2] == f"{primary['name']} \u2192 {standby['name']}" and cells[3] == "exited", cells
        assert all(c.endswith(" ms") for c in cells[4:9]), cells
        after = await browser.screenshot(tmp_path / "status-after.png")
        assert _png_size(after) == (1280, 900)
    finally:
        await browser.close()


async def _until(browser: Browser, expression: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await browser.eval(f"(() => {{ try {{ return !!({expression}); }} catch (e) {{ return false; }} }})()"):
        if time.monotonic() > deadline:
            raise AssertionError(f"the page never showed: {expression}")
        await asyncio.sleep(0.01)
