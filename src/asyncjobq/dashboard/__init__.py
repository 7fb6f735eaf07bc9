"""The dashboard (docs/guides/dashboard.md; extra `asyncjobq[dashboard]`): an ASGI app over a
Queue's public API. `create_app(queue)` to mount it in your ASGI service,
`python -m asyncjobq dashboard APP` to serve it alone.

Pages are rendered on the server (Jinja2, autoescaped) with plain forms; a few lines of
JavaScript refresh the overview and the lists in place. Every asset is served by the app.
"""

from __future__ import annotations

from ..errors import ExtraNotInstalledError

INSTALL = ("the dashboard needs the dashboard extra: pip install 'asyncjobq[dashboard]' "
           "(starlette, jinja2, python-multipart; uvicorn to serve it alone)")

try:
    import jinja2  # noqa: F401
    import python_multipart  # noqa: F401  (Starlette parses the action forms with it)
    import starlette  # noqa: F401
except ImportError:
    raise ExtraNotInstalledError(INSTALL) from None

from ._app import create_app  # noqa: E402

__all__ = ["INSTALL", "create_app"]
