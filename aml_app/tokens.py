"""The bearer tokens of the system's HTTP servers: who may ask.

B's and C's APIs (AML_API_TOKEN, sent by the workers) and every worker's web server (AML_WEB_TOKEN: the
operator page, `/watermarks.json`, `/metrics` and Faust's own routes; sent by Prometheus and
`aml-app status`) answer only requests that carry their token as `Authorization: Bearer <token>`, the
field's way for service calls and scrapes. A browser cannot add that header to the page it opens, so the
worker's page also takes the token once in its address (`/watermarks/?token=...`, as Jupyter does): the
answer is a redirect to the address without it and a session cookie (HttpOnly, SameSite=Strict): its
expiry and an HMAC of it under the token, so that the server ends the session after `SESSION_SECONDS`
whatever the browser keeps, and a cookie read from a browser is not the token. It opens only what the
page reads (`PAGE_PATHS`, GET), never `/metrics` or Faust's routes. Tokens are compared in constant time
and never logged. A load balancer's probe (`/health`) needs none.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable, Collection

from aiohttp import web
from aiohttp.typedefs import Middleware

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: What answers without a token: a load balancer's or an orchestrator's probe.
OPEN_PATHS = frozenset({"/health"})
#: The cookie of a browser that opened the page with the token (`login=True`).
COOKIE = "aml_web_session"
#: The query parameter that carries the token once, in the address a browser opens.
QUERY = "token"
#: How long a session cookie opens the page, checked by the server.
SESSION_SECONDS = 12 * 3600
#: What the session cookie opens (GET and HEAD): the page and the document it polls.
PAGE_PATHS = frozenset({"/watermarks/", "/watermarks.json"})
#: The header of a 401: which scheme to use.
CHALLENGE = ("WWW-Authenticate", 'Bearer realm="aml-app"')


def unauthorized(variable: str, detail: str) -> str:
    """The 401's sentence: `variable` names the setting, `detail` what the request had."""
    return (
        f"This service answers only requests with its token (Authorization: Bearer ..., {variable}); "
        f"this one has {detail}."
    )


def bearer(token: str) -> dict[str, str]:
    """The header that carries `token`; none without one."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def session_cookie(token: str, expires: int) -> str:
    """The cookie's value: when it expires (Unix seconds) and an HMAC of that under the token."""
    mac = hmac.new(token.encode(), f"aml-app operator page|{expires}".encode(), hashlib.sha256).hexdigest()
    return f"{expires}.{mac}"


def session_open(token: str, value: str, now: float) -> bool:
    """Whether `value` is a session cookie this token issued that has not expired at `now`."""
    expires, _, _ = value.partition(".")
    if not (expires.isascii() and expires.isdigit() and len(expires) <= 12) or int(expires) <= now:
        return False
    return hmac.compare_digest(
        value.encode("utf-8", "surrogateescape"), session_cookie(token, int(expires)).encode()
    )


def token_required(
    token: str, variable: str, open_paths: Collection[str] = OPEN_PATHS, login: bool = False
) -> Middleware:
    """A middleware that answers 401 (with `WWW-Authenticate`) to a request without `token`, but for
    `open_paths`. `variable` names the setting in the answer. With `login`, a GET carrying the token in
    `?token=` is redirected to its address without it and given the session cookie, which is then taken
    in place of the header."""
    expected = bearer(token)["Authorization"].encode()

    def refused(detail: str) -> web.Response:
        return web.json_response(
            {"error": unauthorized(variable, detail)}, status=401, headers=dict([CHALLENGE])
        )

    @web.middleware
    async def required(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in open_paths:
            return await handler(request)
        if login and QUERY in request.query:
            if request.method != "GET" or not hmac.compare_digest(
                request.query[QUERY].encode(), token.encode()
            ):
                return refused("another one in its address")
            address = str(request.rel_url.without_query_params(QUERY))
            response = web.Response(status=303, headers={"Location": address})
            expires = int(time.time()) + SESSION_SECONDS
            response.set_cookie(
                COOKIE,
                session_cookie(token, expires),
                httponly=True,
                samesite="Strict",
                path="/",
                max_age=SESSION_SECONDS,
            )
            return response
        # aiohttp keeps a header's undecodable bytes as surrogates: encoded back as they came, a byte
        # that is not UTF-8 is a wrong token (401), not an error (500, which pages as AmlApiErrors).
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if hmac.compare_digest(given, expected):
            return await handler(request)
        if (
            login
            and request.method in ("GET", "HEAD")
            and request.path in PAGE_PATHS
            and session_open(token, request.cookies.get(COOKIE, ""), time.time())
        ):
            return await handler(request)
        return refused("none" if not given else "another one")

    return required
