"""Actions, only when not read-only: POST forms carrying the CSRF token. A read-only app has
none of these routes, so no request can reach them.

Each action answers with a redirect (303) to a page saying what happened: reloading that page
cannot repeat the action.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from .._checks import check_queue_name
from ..errors import ConfigurationError
from ._pages import filters_of, job_id_of, whole_number
from ._security import FIELD
from ._state import Dash, dash_of

# What a bulk action does: the status of the jobs it takes, and its name on the page.
BULK = {"retry": ("failed", "Retry"), "cancel": ("queued", "Cancel")}


async def _checked_form(request: Request) -> tuple[Dash, FormData]:
    dash = dash_of(request)
    form = await request.form()
    why = dash.csrf.refusal(request, form.get(FIELD))
    if why is not None:
        raise HTTPException(403, f"refused: {why}")
    dash.forget()
    return dash, form


def _job_id(request: Request) -> int:
    return job_id_of(request.path_params["job_id"])


def _back(dash: Dash, request: Request, path: str, **query: Any) -> Response:
    target = dash.url(request, path)
    if query:
        target += "?" + urlencode({k: v for k, v in query.items() if v is not None})
    return RedirectResponse(target, status_code=303)


async def retry(request: Request) -> Response:
    dash, _ = await _checked_form(request)
    job_id = _job_id(request)
    ok = await (await dash.ready()).retry(job_id)
    return _back(dash, request, f"/jobs/{job_id}", note="retried" if ok else "not-retried")


async def cancel(request: Request) -> Response:
    dash, _ = await _checked_form(request)
    job_id = _job_id(request)
    q = await dash.ready()
    ok = await q.cancel(job_id)
    info = await q.get(job_id) if ok else None
    note = ("not-cancelled" if not ok else
            "cancel-requested" if info is not None and info.status == "running" else "cancelled")
    return _back(dash, request, f"/jobs/{job_id}", note=note)


def _bulk_of(values: Any) -> tuple[str, str | None, str | None]:
    action = values.get("action", "")
    if action not in BULK:
        raise ConfigurationError(f"action={action!r}: use retry (failed jobs) or cancel "
                                 "(queued jobs)")
    queue = values.get("queue") or None
    task = values.get("task") or None
    for value in (queue, task):
        if value is not None and not isinstance(value, str):
            raise ConfigurationError("queue and task must be text")
    return action, queue, task


async def bulk_preview(request: Request) -> Response:
    """How many jobs the bulk action would take, and the form that confirms it."""
    dash = dash_of(request)
    filters_of(request)
    action, queue, task = _bulk_of(request.query_params)
    status, label = BULK[action]
    q = await dash.ready()
    # The newest matching job bounds the action: the form carries its id, and the POST takes
    # only jobs up to it, so jobs enqueued (or newly failed) after this preview are not
    # touched by a click on it. The count is of the same jobs.
    newest = (await q.list_jobs(queue=queue, status=status, task=task, limit=1)).jobs
    max_id = newest[0].id if newest else None
    count = 0 if max_id is None else await q.count_jobs(queue=queue, status=status, task=task,
                                                        max_id=max_id)
    return dash.render(request, "bulk.html", page="jobs", action=action, label=label,
                       status=status, queue=queue, task=task, count=count, max_id=max_id)


def _form_number(form: FormData, name: str) -> int:
    raw = form.get(name)
    value = whole_number(raw) if isinstance(raw, str) else None
    if value is None:
        raise ConfigurationError(f"{name}: the form lacks the preview's {name} (a whole number "
                                 "from 1): open the bulk action's preview again")
    return value


async def bulk(request: Request) -> Response:
    dash, form = await _checked_form(request)
    action, queue, task = _bulk_of(form)
    max_id = _form_number(form, "max_id")
    previewed = _form_number(form, "count")
    q = await dash.ready()
    # Only jobs up to the preview's newest, and never more than it counted: a job that
    # became failed or queued again since (an older id: a retry, a backoff) may take the
    # place of one that left, but the action touches no more jobs than the page said.
    if action == "retry":
        n = int(await q.retry_failed(queue=queue, task=task, max_id=max_id, limit=previewed))
    else:
        n = await q.cancel_queued(queue=queue, task=task, max_id=max_id, limit=previewed)
    status = BULK[action][0]
    return _back(dash, request, "/jobs", status=status, queue=queue, task=task,
                 note="bulk-retried" if action == "retry" else "bulk-cancelled", n=n,
                 of=previewed)


async def pause(request: Request) -> Response:
    return await _pause_or_resume(request, pause=True)


async def resume(request: Request) -> Response:
    return await _pause_or_resume(request, pause=False)


async def _pause_or_resume(request: Request, *, pause: bool) -> Response:
    dash, form = await _checked_form(request)
    name = form.get("queue")
    check_queue_name(name)
    assert isinstance(name, str)
    q = await dash.ready()
    await (q.pause(name) if pause else q.resume(name))
    return _back(dash, request, "/", note="paused" if pause else "resumed")


def routes() -> list[Route]:
    return [Route("/jobs/{job_id}/retry", retry, methods=["POST"]),
            Route("/jobs/{job_id}/cancel", cancel, methods=["POST"]),
            Route("/bulk", bulk_preview, methods=["GET"]),
            Route("/bulk", bulk, methods=["POST"]),
            Route("/pause", pause, methods=["POST"]),
            Route("/resume", resume, methods=["POST"])]
