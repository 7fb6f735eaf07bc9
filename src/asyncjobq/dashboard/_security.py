"""Who may see the dashboard (`auth`) and proof that an action's form came from it (CSRF).

CSRF: a signed double-submit token. The token is random bytes and their HMAC under a secret
drawn when the app is created; it is set in an HttpOnly, SameSite=Strict cookie and repeated in
each form's hidden field. An action needs both, equal (hmac.compare_digest), and the signature
valid. The signature alone does not stop a sibling subdomain that can plant cookies: it can
fetch a page of the dashboard itself, get a token the app signed, plant that in the cookie and
repeat it in its form. What refuses such a form is the Origin check: the request's Origin (or
Sec-Fetch-Site) must be this site, so a form posted from another origin (a sibling subdomain
included) is refused, even by a browser that ignores SameSite.

Host: with `allowed_hosts` (create_app; the CLI always sets it) a request naming another Host
is refused (400) before anything else runs, so a DNS-rebinding page (evil.example resolved to
127.0.0.1) can neither read pages nor post actions: its requests carry Host evil.example, and
the Origin check alone would accept them (Origin and Host agree there).

Every response also says it may not be framed (X-Frame-Options, CSP frame-ancestors) and runs
only the app's own script and style (Content-Security-Policy).
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import logging
import re
import secrets
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("asyncjobq.dashboard")

Auth = Callable[[Request], bool | Awaitable[bool]]
COOKIE = "asyncjobq_csrf"
FIELD = "csrf_token"
# What new_token makes. Anything else (a planted cookie, a forged field) is refused by its
# shape before compare_digest, which raises TypeError on a non-ASCII str: that was a 500 on
# every page, so whoever could plant a cookie locked users out.
TOKEN_SHAPE = re.compile(r"[0-9a-f]{32}\.[0-9a-f]{64}")


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


# Only the app's own script (dash.js), style (dash.css), images and fetches; forms post only to
# it; no page may frame it (clickjacking of the action buttons).
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"x-frame-options": "DENY", "content-security-policy": CSP,
                    "x-content-type-options": "nosniff",
                    "referrer-policy": "same-origin"}


class SecurityHeaders:
    """ASGI middleware: SECURITY_HEADERS on every HTTP response (refusals included)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers[name] = value
            await send(message)

        await self.app(scope, receive, send_with_headers)


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
        if token is None or TOKEN_SHAPE.fullmatch(token) is None:
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
        # The field's shape first, as valid() checks the cookie's: a multipart form may name
        # a charset (UTF-7) that decodes the field into a lone surrogate, which encode()
        # refuses with UnicodeEncodeError, a 500 instead of this refusal.
        if not (TOKEN_SHAPE.fullmatch(form_token) is not None and self.valid(cookie)
                and hmac.compare_digest(cookie.encode(), form_token.encode())):
            return "the form's CSRF token does not match: reload the page and try again"
        return None
