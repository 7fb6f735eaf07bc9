"""Who may see the dashboard (`auth`) and proof that an action's form came from it (CSRF).

CSRF: a signed double-submit token. The token is random bytes and their HMAC under a secret
drawn when the app is created; it is set in an HttpOnly, SameSite=Strict cookie and repeated in
each form's hidden field. An action needs both, equal (hmac.compare_digest), and the signature
valid: a sibling subdomain that can plant a cookie cannot mint one the app accepts. The
request's Origin (or Sec-Fetch-Site) must also be this site, so a cross-site form is refused
even by a browser that ignores SameSite.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import logging
import secrets
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("asyncjobq.dashboard")

Auth = Callable[[Request], bool | Awaitable[bool]]
COOKIE = "asyncjobq_csrf"
FIELD = "csrf_token"


class AuthGate:
    """ASGI middleware: every HTTP request, assets included, goes through `auth` first."""

    def __init__(self, app: ASGIApp, auth: Auth | None) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.auth is not None:
            try:
                allowed = self.auth(Request(scope, receive))
                if inspect.isawaitable(allowed):
                    allowed = await allowed
            except Exception:
                # A broken auth callable must not open the dashboard: refuse, and say why in
                # the log (never to the client).
                log.exception("dashboard auth callable raised: refusing the request")
                allowed = False
            if allowed is not True:
                response = PlainTextResponse("forbidden: the dashboard's auth refused this "
                                             "request", status_code=403)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Csrf:
    def __init__(self) -> None:
        # Per app: tokens do not outlive the process that signed them (a restart asks for a
        # page reload before the next action), and no configuration is needed.
        self._secret = secrets.token_bytes(32)

    def _sign(self, nonce: str) -> str:
        return hmac.new(self._secret, nonce.encode(), hashlib.sha256).hexdigest()

    def new_token(self) -> str:
        nonce = secrets.token_hex(16)
        return f"{nonce}.{self._sign(nonce)}"

    def valid(self, token: str | None) -> bool:
        if not token or token.count(".") != 1:
            return False
        nonce, mac = token.split(".")
        return hmac.compare_digest(mac, self._sign(nonce))

    def token_for(self, request: Request) -> tuple[str, bool]:
        """(the token for this page's forms, whether the cookie must be set)."""
        current = request.cookies.get(COOKIE)
        if current is not None and self.valid(current):
            return current, False
        return self.new_token(), True

    def refusal(self, request: Request, form_token: object) -> str | None:
        """Why this POST is refused, or None when it is this dashboard's own form."""
        site = request.headers.get("sec-fetch-site")
        if site is not None and site not in ("same-origin", "none"):
            return f"a {site} request may not act on the dashboard"
        origin = request.headers.get("origin")
        if origin is not None:
            # A proxy that rewrites Host names the original in X-Forwarded-Host; a cross-site
            # form cannot set that header, so either may match.
            hosts = {request.headers.get("host", ""),
                     request.headers.get("x-forwarded-host", "").split(",")[0].strip()}
            if origin == "null" or urlsplit(origin).netloc not in hosts - {""}:
                return f"the request comes from another site ({origin})"
        cookie = request.cookies.get(COOKIE)
        if not isinstance(form_token, str) or cookie is None:
            return "the form's CSRF token or its cookie is missing: reload the page"
        if not (hmac.compare_digest(cookie.encode(), form_token.encode())
                and self.valid(cookie)):
            return "the form's CSRF token does not match: reload the page and try again"
        return None
