"""`/metrics` (Prometheus) and `/health` for the processes without a web server of their own: the
pipeline's driver and the enrichment stage.

As a worker's web server: bound to a loopback address, it answers only requests addressed to one; with a
token (AML_WEB_TOKEN), only requests that carry it, but `/health`, which answers 200 while the process
serves (a supervisor's liveness check)."""

from __future__ import annotations

import hmac
import json
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from aml_app.loopback import host_name, is_loopback, misdirected
from aml_app.tokens import CHALLENGE, OPEN_PATHS, bearer, unauthorized

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def serve_metrics(
    registry: CollectorRegistry, service: str, host: str, port: int, token: str = ""
) -> ThreadingWSGIServer:
    """Serve `registry` on host:port from a daemon thread, `/health` naming `service`; OSError if the
    port cannot be bound."""
    app = guarded(make_wsgi_app(registry), service, token, is_loopback(host))
    server = make_server(host, port, app, ThreadingWSGIServer, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name=f"{service} metrics", daemon=True).start()
    return server


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No line per scrape on the process's log."""


def guarded(app: WsgiApp, service: str, token: str, loopback_only: bool) -> WsgiApp:
    """`app` behind the checks of `aml_app.loopback` and `aml_app.tokens`, for a WSGI server."""
    expected = bearer(token).get("Authorization", "").encode()

    def answer(start: Callable[..., Any], status: str, doc: dict[str, str], *headers: Any) -> list[bytes]:
        start(status, [("Content-Type", "application/json"), *headers])
        return [json.dumps(doc).encode()]

    def checked(environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
        host = environ.get("HTTP_HOST", "")
        if loopback_only and not is_loopback(host_name(host)):
            return answer(start, "421 Misdirected Request", {"error": misdirected(host)})
        if environ.get("PATH_INFO", "") in OPEN_PATHS:
            return answer(start, "200 OK", {"service": service})
        given = environ.get("HTTP_AUTHORIZATION", "").encode()
        if expected and not hmac.compare_digest(given, expected):
            detail = "another one" if given else "none"
            error = {"error": unauthorized("AML_WEB_TOKEN", detail)}
            return answer(start, "401 Unauthorized", error, CHALLENGE)
        return app(environ, start)

    return checked
