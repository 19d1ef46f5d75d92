"""The operator page's session cookie (`aml_app.tokens`): it expires on the server, not only in the
browser, and opens what the page reads and nothing else. A real aiohttp server on loopback."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from aml_app.tokens import COOKIE, SESSION_SECONDS, session_cookie, session_open, token_required

TOKEN = "a-web-token-of-" + "w" * 24


async def ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


@pytest.fixture
async def server() -> AsyncIterator[TestServer]:
    app = web.Application(middlewares=[token_required(TOKEN, "AML_WEB_TOKEN", login=True)])
    for path in ("/watermarks/", "/watermarks.json", "/metrics", "/table/watermarks/"):
        app.router.add_get(path, ok)
    app.router.add_post("/watermarks.json", ok)
    async with TestServer(app, host="127.0.0.1") as served:
        yield served


async def status(server: TestServer, path: str, cookie: str, method: str = "GET") -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, server.make_url(path), headers={"Cookie": f"{COOKIE}={cookie}"}) as r,
    ):
        return r.status


async def test_the_login_cookie_expires_on_the_server_and_opens_only_the_page(server: TestServer) -> None:
    async with (
        aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session,
        session.get(server.make_url(f"/watermarks/?token={TOKEN}"), allow_redirects=False) as r,
    ):
        assert r.status == 303
        issued = r.cookies[COOKIE].value
        assert TOKEN not in issued and int(r.cookies[COOKIE]["max-age"]) == SESSION_SECONDS
    expires = int(issued.partition(".")[0])
    assert abs(expires - (time.time() + SESSION_SECONDS)) < 60
    assert await status(server, "/watermarks/", issued) == 200
    assert await status(server, "/watermarks.json", issued) == 200
    # Not what the page does not read, nor a write.
    assert await status(server, "/metrics", issued) == 401
    assert await status(server, "/table/watermarks/", issued) == 401
    assert await status(server, "/watermarks.json", issued, "POST") == 401
    # Expired, though the browser still sends it; or with its expiry moved on.
    assert await status(server, "/watermarks.json", session_cookie(TOKEN, int(time.time()) - 1)) == 401
    moved = f"{expires + 10**6}.{issued.partition('.')[2]}"
    assert await status(server, "/watermarks.json", moved) == 401


def test_a_session_cookie_is_open_only_as_issued_and_until_it_expires() -> None:
    now = 1_000_000.0
    value = session_cookie(TOKEN, 1_000_100)
    assert session_open(TOKEN, value, now)
    assert not session_open(TOKEN, value, 1_000_100.0)  # at its expiry
    assert not session_open("another-token-of-" + "x" * 24, value, now)
    for bad in (
        "",
        ".",
        "abc.def",
        "\uff11" * 7 + "." + value.partition(".")[2],
        value + "0",
        "1" * 40 + ".x",
    ):
        assert not session_open(TOKEN, bad, now), bad
