"""The dashboard mounted in a service of your own at /admin/jobs/, behind the authenticating
proxy in front of it (oauth2-proxy and the like set X-Forwarded-Email): only staff see it.

    uvicorn examples.dashboard_app:app       # then http://127.0.0.1:8000/admin/jobs/
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Mount

import asyncjobq
from asyncjobq.dashboard import create_app

queue = asyncjobq.Queue(schema=os.environ.get("QUEUE_SCHEMA", "asyncjobq"))
STAFF = set(os.environ.get("STAFF_EMAILS", "ops@example.com").split(","))


def is_staff(request: Request) -> bool:
    # Asked for every request, the dashboard's assets too; anything but True is a 403.
    return request.headers.get("x-forwarded-email") in STAFF


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with queue:  # the service opens the queue: a mounted app's lifespan does not run
        yield


app = Starlette(routes=[Mount("/admin/jobs", create_app(queue, auth=is_staff))],
                lifespan=lifespan)
