"""The pipeline's /metrics server behind the same checks as the workers' web servers: a real server on a
free port, asked over HTTP (urllib, as a container's probe does)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from aml_app.kafka.broker import free_port
from aml_app.pipeline.metrics import PipelineMetrics
from aml_app.tokens import bearer

TOKEN = "a-metrics-token-of-" + "z" * 20


def ask(port: int, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture(scope="module")
def served() -> Iterator[int]:
    port = free_port()
    server = PipelineMetrics().serve("127.0.0.1", port, TOKEN)
    yield port
    server.shutdown()
    server.server_close()


def test_metrics_answer_only_with_the_token_and_health_always(served: int) -> None:
    for headers in ({}, bearer("another-token-of-24-chars"), {"Authorization": TOKEN}):
        status, body = ask(served, "/metrics", headers)
        assert status == 401, headers
        error = json.loads(body)["error"]
        assert "AML_WEB_TOKEN" in error and TOKEN not in error
    status, body = ask(served, "/metrics", bearer(TOKEN))
    assert status == 200 and b"aml_pipeline_batches_total" in body
    assert ask(served, "/health", {}) == (200, b'{"service": "pipeline"}')


def test_bound_to_loopback_it_answers_only_names_of_this_machine(served: int) -> None:
    status, body = ask(served, "/metrics", {**bearer(TOKEN), "Host": "evil.example"})
    assert status == 421 and "loopback" in json.loads(body)["error"]
    assert ask(served, "/health", {"Host": "evil.example:80"})[0] == 421
    for host in ("localhost", f"127.0.0.1:{served}", "[::1]"):
        assert ask(served, "/metrics", {**bearer(TOKEN), "Host": host})[0] == 200, host


def test_without_a_token_it_answers_anyone_on_this_machine() -> None:
    port = free_port()
    server = PipelineMetrics().serve("127.0.0.1", port)
    try:
        assert ask(port, "/metrics", {})[0] == 200
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "header",
    [b"Authorization: Bearer \xff", b"Cookie: aml_web_session=99999999999.\xffab"],
    ids=["token", "session cookie"],
)
async def test_a_header_byte_that_is_not_utf8_is_refused_not_an_error(header: bytes) -> None:
    """aiohttp keeps such a byte as a surrogate, which `.encode()` could not take: a caller without the
    token got a 500 and a traceback, which counts in AmlApiErrors. It is a wrong token: 401."""
    from aiohttp import web

    from aml_app.tokens import token_required

    async def page(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(middlewares=[token_required(TOKEN, "AML_WEB_TOKEN", login=True)])
    app.router.add_get("/watermarks.json", page)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"GET /watermarks.json HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + header
            + b"\r\nConnection: close\r\n\r\n"
        )
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        assert status_line.split()[1] == b"401", status_line
    finally:
        await runner.cleanup()
