"""The Host check of every HTTP server of the system bound to a loopback address.

A server bound to 127.0.0.1 is reachable from a browser on the same machine, and a web page whose name an
attacker points at 127.0.0.1 (DNS rebinding) is same-origin with it; its requests still name the
attacker's host. Such a server answers only requests addressed to a loopback name: B's and C's APIs
(`aml_app.dependencies.api`) and every worker's web server (its operator page and `/metrics`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable

from aiohttp import web


def host_name(host: str) -> str:
    """The name or address of a Host header, without its port ("[::1]:8081" -> "::1")."""
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0]


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or name to bind or call) is this machine only."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@web.middleware
async def loopback_hosts_only(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Refuse (421) a request whose Host header names another machine than this one."""
    if not is_loopback(host_name(request.host or "")):
        return web.json_response({"error": misdirected(request.host)}, status=421)
    return await handler(request)


def misdirected(host: str | None) -> str:
    """The 421's sentence."""
    return (
        "This server listens on a loopback address and answers only requests addressed to one; "
        f"this one was addressed to {host!r}."
    )
