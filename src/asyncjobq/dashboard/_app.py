"""create_app: the routes, the shared state of one dashboard, rendering and errors."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import resources
from typing import Any

import jinja2
import psycopg
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import BaseRoute, Mount, Route

from ..errors import AsyncJobQError, ConfigurationError, reason
from ..queue import Queue
from ._security import COOKIE, FIELD, Auth, AuthGate, Csrf

log = logging.getLogger("asyncjobq.dashboard")

_ASSETS = {"dash.css": "text/css; charset=utf-8",
           "dash.js": "text/javascript; charset=utf-8"}
# Seconds the overview's figures are reused: ten wall screens refreshing every 5 s cost the
# database what one does.
OVERVIEW_TTL = 2.0
REFRESH_SECONDS = 5


@dataclass
class Dash:
    """One dashboard: its queue, its mode and what its requests share."""

    queue: Queue
    read_only: bool
    base_path: str
    env: jinja2.Environment
    csrf: Csrf = field(default_factory=Csrf)
    opened_here: bool = False
    _open_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _cache: dict[str, tuple[float, Any]] = field(default_factory=dict)

    async def ready(self) -> Queue:
        """The queue, opened on first use when no lifespan did (a mounted app's lifespan does
        not run: Starlette runs only the outer app's)."""
        if not self.queue.database.is_open:
            async with self._open_lock:
                if not self.queue.database.is_open:
                    await self.queue.open()
                    self.opened_here = True
        return self.queue

    async def cached(self, key: str, make: Callable[[], Awaitable[Any]]) -> Any:
        hit = self._cache.get(key)
        if hit is not None and time.monotonic() - hit[0] < OVERVIEW_TTL:
            return hit[1]
        value = await make()
        self._cache[key] = (time.monotonic(), value)
        return value

    def forget(self) -> None:
        """After an action: the next page shows its effect, not cached figures."""
        self._cache.clear()

    def url(self, request: Request, path: str) -> str:
        return f"{request.scope.get('root_path', '')}{self.base_path}{path}"

    def render(self, request: Request, template: str, status_code: int = 200,
               **context: Any) -> HTMLResponse:
        token, set_cookie = self.csrf.token_for(request)
        html = self.env.get_template(template).render(
            dash=self, request=request, csrf_field=FIELD, csrf_token=token,
            url=lambda path: self.url(request, path), refresh=REFRESH_SECONDS,
            now=datetime.now(UTC), **{"page": "", "note": None, **context})
        response = HTMLResponse(html, status_code=status_code)
        response.headers["cache-control"] = "no-store"
        if set_cookie:
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict",
                                secure=request.url.scheme == "https",
                                path=self.url(request, "/") or "/")
        return response


def dash_of(request: Request) -> Dash:
    dash: Dash = request.app.state.dash
    return dash


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("asyncjobq.dashboard", "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters["age"] = _age
    env.filters["ts"] = _ts
    env.filters["pretty"] = lambda v: json.dumps(v, indent=2, ensure_ascii=False,
                                                 sort_keys=True)
    return env


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    m = int(seconds // 60)
    if m < 60:
        return f"{m}m {int(seconds % 60)}s"
    h = m // 60
    return f"{h}h {m % 60}m" if h < 48 else f"{h // 24}d {h % 24}h"


def _ts(t: datetime | None) -> str:
    return "-" if t is None else t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


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
    from . import _actions, _pages

    if not isinstance(queue, Queue):
        raise ConfigurationError(f"create_app takes an asyncjobq.Queue, got {queue!r}")
    if auth is not None and not callable(auth):
        raise ConfigurationError(f"auth={auth!r}: pass a callable taking the request and "
                                 "returning True to allow it, or None")
    if base_path and (not base_path.startswith("/") or base_path.endswith("/")):
        raise ConfigurationError(f"base_path={base_path!r}: use '' or a path starting with / "
                                 "and not ending with one, e.g. '/jobs-admin'")
    dash = Dash(queue, bool(read_only), base_path, _environment())
    routes: list[BaseRoute] = [*_pages.routes(),
                               Route("/static/{name}", _asset, methods=["GET"])]
    if not read_only:
        routes += _actions.routes()
    if base_path:
        routes = [Mount(base_path, routes=routes)]

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        await dash.ready()
        try:
            yield
        finally:
            if dash.opened_here:
                await queue.close()

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=_errors())
    app.state.dash = dash
    app.add_middleware(AuthGate, auth=auth)
    return app
