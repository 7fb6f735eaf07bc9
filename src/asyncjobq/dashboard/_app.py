"""create_app: the routes, the assets and the error pages."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

import psycopg
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import BaseRoute, Mount, Route

from ..errors import AsyncJobQError, ConfigurationError, reason
from ..queue import Queue
from . import _actions, _pages
from ._security import Auth, AuthGate, SecurityHeaders
from ._state import Dash, environment

log = logging.getLogger("asyncjobq.dashboard")

_ASSETS = {"dash.css": "text/css; charset=utf-8",
           "dash.js": "text/javascript; charset=utf-8"}


async def _asset(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in _ASSETS:
        raise HTTPException(404, f"no asset {name!r}")
    body = (resources.files("asyncjobq.dashboard") / "static" / name).read_bytes()
    return Response(body, media_type=_ASSETS[name],
                    headers={"cache-control": "private, max-age=300"})


def _errors() -> dict[Any, Any]:
    # Bad input and a database in trouble get a page that says so, never a traceback.
    async def page(request: Request, status: int, title: str, message: str) -> Response:
        dash: Dash | None = getattr(request.app.state, "dash", None)
        if dash is None:
            return HTMLResponse(message, status_code=status)
        return dash.render(request, "error.html", status_code=status, title=title,
                           message=message)

    async def bad_input(request: Request, exc: Exception) -> Response:
        return await page(request, 400, "Bad request", str(exc))

    async def unavailable(request: Request, exc: Exception) -> Response:
        log.warning("dashboard: %s", exc)
        text = f"database error: {reason(exc)}" if isinstance(exc, psycopg.Error) else str(exc)
        return await page(request, 503, "Unavailable", text)

    async def http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            return Response("method not allowed", status_code=405,
                            headers=dict(exc.headers or {}))
        return await page(request, exc.status_code, "Not found" if exc.status_code == 404
                          else "Error", str(exc.detail))

    return {ConfigurationError: bad_input, AsyncJobQError: unavailable,
            psycopg.Error: unavailable, HTTPException: http}


def host_patterns(allowed_hosts: object) -> list[str]:
    """allowed_hosts as TrustedHostMiddleware matches them (IPv6 in brackets, lower case), or
    ConfigurationError saying what is wrong."""
    if isinstance(allowed_hosts, str) or not isinstance(allowed_hosts, Sequence | set |
                                                            frozenset):
        raise ConfigurationError(f"allowed_hosts={allowed_hosts!r}: pass a list of host names, "
                                 "e.g. ['localhost', '127.0.0.1', 'jobs.example.com'], or None")
    out: list[str] = []
    for host in allowed_hosts:
        if not isinstance(host, str) or not host.strip():
            raise ConfigurationError(f"allowed_hosts: {host!r} is not a host name")
        h = host.strip().lower()
        if h.count(":") > 1 and not h.startswith("["):
            h = f"[{h}]"  # an IPv6 address, as the Host header carries it
        if (h.startswith("[") and not h.endswith("]")) or (not h.startswith("[") and ":" in h):
            raise ConfigurationError(f"allowed_hosts: {host!r}: give the host without a port "
                                     "(any port is allowed)")
        if "*" in h[1:] or (h.startswith("*") and h != "*" and not h.startswith("*.")):
            raise ConfigurationError(f"allowed_hosts: {host!r}: a wildcard must be the whole "
                                     "name ('*', no check) or lead it, as in '*.example.com'")
        out.append(h)
    if not out:
        raise ConfigurationError("allowed_hosts=[]: would refuse every request; pass the host "
                                 "names the dashboard is reached by, or None for no check")
    return out


def create_app(queue: Queue, *, read_only: bool = False, auth: Auth | None = None,
               base_path: str = "", allowed_hosts: Sequence[str] | None = None) -> Starlette:
    """The dashboard of `queue`, an ASGI app.

    Args:
        queue: the Queue to show; opened by the app's lifespan (or on first request when
            mounted in another app) unless it is open already, and then closed by it.
        read_only: no actions at all: their routes do not exist (404/405).
        auth: called with each request (a starlette Request; sync or async), assets
            included; anything but True is refused with 403.
        base_path: the URL prefix the app is served under, e.g. "/jobs-admin".
        allowed_hosts: the host names (no port) requests may name in their Host header, e.g.
            ["localhost", "127.0.0.1", "[::1]"]; any other is refused with 400 before auth
            runs (DNS rebinding: a hostile page whose name resolves to your address sends its
            own Host). `"*.example.com"` allows subdomains. None: no check (the service the app
            is mounted in checks Host itself).
    """
    if not isinstance(queue, Queue):
        raise ConfigurationError(f"create_app takes an asyncjobq.Queue, got {queue!r}")
    if auth is not None and not callable(auth):
        raise ConfigurationError(f"auth={auth!r}: pass a callable taking the request and "
                                 "returning True to allow it, or None")
    if base_path and (not base_path.startswith("/") or base_path.endswith("/")):
        raise ConfigurationError(f"base_path={base_path!r}: use '' or a path starting with / "
                                 "and not ending with one, e.g. '/jobs-admin'")
    hosts = None if allowed_hosts is None else host_patterns(allowed_hosts)
    dash = Dash(queue, bool(read_only), base_path, environment())
    routes: list[BaseRoute] = [*_pages.routes(),
                               Route("/static/{name}", _asset, methods=["GET"])]
    if not read_only:
        routes += _actions.routes()
    if base_path:
        routes = [Mount(base_path, routes=routes)]

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        try:
            await dash.ready()
        except (AsyncJobQError, psycopg.Error) as e:
            # Up without its database (a wall screen outlives restarts of it): each page says
            # why and tries to open the queue again.
            log.warning("dashboard: cannot open the queue yet (%s); pages will say so until "
                        "the database answers", e)
        try:
            yield
        finally:
            if dash.opened_here:
                await queue.close()

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=_errors())
    app.state.dash = dash
    # Outermost first: the security headers on every response, then the Host check (before
    # auth runs), then auth.
    app.add_middleware(AuthGate, auth=auth)
    if hosts is not None:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=hosts, www_redirect=False)
    app.add_middleware(SecurityHeaders)
    return app
