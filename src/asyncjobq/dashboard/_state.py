"""What one dashboard's requests share: its queue, mode, CSRF secret, cache and templates."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse

from ..queue import Queue
from ._security import COOKIE, FIELD, Csrf

# Seconds the overview's figures are reused: ten wall screens refreshing every 5 s cost the
# database what one does.
OVERVIEW_TTL = 2.0
REFRESH_SECONDS = 5
# Seconds the doctor's findings are reused: diagnose() reads all of history, so each page view
# must not run it again (nor may two views run it at once).
DOCTOR_TTL = 30.0


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
    _doctor_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _doctor: tuple[float, datetime, Any] | None = None

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

    async def doctor_report(self, make: Callable[[], Awaitable[Any]]) -> tuple[datetime, Any]:
        """(when it was computed, the report): made at most once per DOCTOR_TTL seconds, by
        one request at a time; the others wait for it and share it."""
        async with self._doctor_lock:
            hit = self._doctor
            if hit is None or time.monotonic() - hit[0] >= DOCTOR_TTL:
                report = await make()
                hit = self._doctor = (time.monotonic(), datetime.now(UTC), report)
            return hit[1], hit[2]

    def forget(self) -> None:
        """After an action: the next page shows its effect, not cached figures."""
        self._cache.clear()

    def url(self, request: Request, path: str) -> str:
        # Inside the app's own Mount(base_path) (and any outer one) root_path ends with
        # base_path already; outside it (a 404 page) it does not.
        prefix = request.scope.get("root_path", "")
        if not prefix.endswith(self.base_path):
            prefix += self.base_path
        return f"{prefix}{path}"

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


def environment() -> jinja2.Environment:
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
