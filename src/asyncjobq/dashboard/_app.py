"""create_app: the routes, the assets and the error pages."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

import psycopg
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import BaseRoute, Mount, Route

from ..errors import AsyncJobQError, ConfigurationError, reason
from ..queue import Queue
from . import _actions, _pages
from ._security import Auth, AuthGate
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


def create_app(queue: Queue, *, read_only: bool = False, auth: Auth | None = None,
               base_path: str = "") -> Starlette:
    """The dashboard of `queue`, an ASGI app.

    Args:
        queue: the Queue to show; opened by the app's lifespan (or on first request when
            mounted in another app) unless it is open already, and then closed by it.
        read_only: no actions at all: their routes do not exist (404/405).
        auth: called with each request (a starlette Request; sync or async), assets
            included; anything but True is refused with 403.
        base_path: the URL prefix the app is served under, e.g. "/jobs-admin".
    """
    if not isinstance(queue, Queue):
        raise ConfigurationError(f"create_app takes an asyncjobq.Queue, got {queue!r}")
    if auth is not None and not callable(auth):
        raise ConfigurationError(f"auth={auth!r}: pass a callable taking the request and "
                                 "returning True to allow it, or None")
    if base_path and (not base_path.startswith("/") or base_path.endswith("/")):
        raise ConfigurationError(f"base_path={base_path!r}: use '' or a path starting with / "
                                 "and not ending with one, e.g. '/jobs-admin'")
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
    app.add_middleware(AuthGate, auth=auth)
    return app
