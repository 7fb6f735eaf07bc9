"""The pages (GET only): overview, jobs list, job detail, schedules, doctor findings."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from ..errors import ConfigurationError
from ..job import STATUSES
from ._chart import throughput_chart
from ._state import DOCTOR_TTL, dash_of

# What an action's redirect may say (the URL carries only the key and a count: a link
# cannot make the page say anything else).
NOTES = {
    "retried": "Job requeued.",
    "not-retried": "Not requeued: the job is not failed, or another job holds its dedup_key.",
    "cancelled": "Job cancelled.",
    "not-cancelled": "Not cancelled: the job has finished.",
    "cancel-requested": "Cancel requested: the job's worker stops it and writes cancelled.",
    "bulk-retried": "Requeued {n} failed job(s).",
    "bulk-cancelled": "Cancelled {n} queued job(s).",
    "paused": "Queue paused.",
    "resumed": "Queue resumed.",
}


def whole_number(raw: str) -> int | None:
    """`raw` as an int from 1 to 2**63 - 1 (a bigint id), else None. ASCII digits only, at most
    19 of them: str.isdigit() takes '²' (int() then raises), and int() refuses strings of more
    than 4300 digits; neither may become a 500."""
    if re.fullmatch(r"[0-9]{1,19}", raw) is None:
        return None
    value = int(raw)
    return value if 1 <= value < 2**63 else None


def job_id_of(raw: str) -> int:
    """A job id from a URL path, ConfigurationError (400) saying what is wrong otherwise."""
    value = whole_number(raw)
    if value is None:
        raise ConfigurationError(f"{raw[:40]!r} is not a job id: use a whole number from 1 "
                                 "to 9223372036854775807")
    return value


def note_of(request: Request) -> str | None:
    text = NOTES.get(request.query_params.get("note", ""))
    if text is None:
        return None
    counts = {}
    for name in ("n", "of"):
        raw = request.query_params.get(name, "")
        value = 0 if raw == "0" else whole_number(raw) if raw else None
        if raw and value is None:
            raise ConfigurationError(f"{name}={raw[:40]!r}: use a whole number from 0")
        counts[name] = value
    shown = text.format(n="some" if counts["n"] is None else counts["n"])
    if counts["of"] is not None and "{n}" in text:
        shown += f" The preview counted {counts['of']}."
    return shown


# last_error holds every attempt's error, each line-led by "attempt N: ", joined by newlines and
# cut to its last 8000 characters (sql/claim.py): split back into one entry per attempt.
_ATTEMPT = re.compile(r"^attempt (\d+): ", re.MULTILINE)


def attempt_errors(text: str | None) -> list[tuple[str, str]]:
    """[(attempt label, its error)] in attempt order; text before the first marker (cut by
    the 8000-character limit, or written by another tool) gets the label "earlier"."""
    if not text:
        return []
    marks = list(_ATTEMPT.finditer(text))
    out: list[tuple[str, str]] = []
    if not marks or marks[0].start() > 0:
        head = text[:marks[0].start() if marks else len(text)].strip()
        if head:
            out.append(("earlier" if marks else "error", head))
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        out.append((f"attempt {m.group(1)}", text[m.end():end].rstrip("\n")))
    return out


def _int_param(request: Request, name: str) -> int | None:
    raw = request.query_params.get(name, "").strip()
    if not raw:
        return None
    value = whole_number(raw)
    if value is None:
        raise ConfigurationError(f"{name}={raw[:40]!r}: use a job id, a whole number from 1 "
                                 "to 9223372036854775807")
    return value


def filters_of(request: Request) -> dict[str, str | None]:
    """queue, status and task from the query string ('' is no filter), status checked."""
    out: dict[str, str | None] = {}
    for name in ("queue", "status", "task"):
        value = request.query_params.get(name, "")
        out[name] = value if value else None
    if out["status"] is not None and out["status"] not in STATUSES:
        raise ConfigurationError(f"status={out['status']!r}: use one of "
                                 f"{', '.join(STATUSES)}, or leave it empty for all")
    return out


async def overview(request: Request) -> Response:
    dash = dash_of(request)
    q = await dash.ready()

    async def gather() -> dict[str, Any]:
        stats, health, paused, leader, workers, rows = await asyncio.gather(
            q.stats(), q.health(), q.paused(), q.leader(), q.workers_seen(), q.throughput(60))
        names = sorted(set(stats) | set(paused) | set(health))
        queues = [{"name": n, "counts": stats.get(n, dict.fromkeys(STATUSES, 0)),
                   "oldest": health.get(n, {}).get("oldest_queued_age_s"),
                   "paused_at": paused.get(n)} for n in names]
        return {"queues": queues, "leader": leader, "workers": workers,
                "chart": throughput_chart(rows)}

    data = await dash.cached("overview", gather)
    return dash.render(request, "overview.html", page="overview", note=note_of(request),
                       statuses=STATUSES, **data)


async def jobs(request: Request) -> Response:
    dash = dash_of(request)
    wanted = _int_param(request, "id")
    if wanted is not None:
        return RedirectResponse(dash.url(request, f"/jobs/{wanted}"), status_code=303)
    f = filters_of(request)
    before = _int_param(request, "before")
    q = await dash.ready()
    page = await q.list_jobs(queue=f["queue"], status=f["status"], task=f["task"],
                             before=before, limit=50)
    return dash.render(request, "jobs.html", page="jobs", filters=f, jobs_page=page,
                       before=before, statuses=STATUSES, note=note_of(request))


async def job(request: Request) -> Response:
    dash = dash_of(request)
    job_id = job_id_of(request.path_params["job_id"])
    q = await dash.ready()
    detail = await q.get_detail(job_id)
    if detail is None:
        raise HTTPException(404, f"no job {job_id}: it never existed, or finished and was "
                                 "pruned from history")
    return dash.render(request, "job.html", page="jobs", job=detail, note=note_of(request),
                       errors=attempt_errors(detail.last_error))


async def schedules(request: Request) -> Response:
    dash = dash_of(request)
    q = await dash.ready()
    problem = None
    registered: list[dict[str, Any]] = []
    try:
        registered = await q.list_schedules()
    except ConfigurationError as e:
        problem = str(e)
    known = {s["name"] for s in registered}
    others = {name: tick for name, tick in (await q.last_ticks()).items() if name not in known}
    return dash.render(request, "schedules.html", page="schedules", schedules=registered,
                       others=others, problem=problem)


async def doctor(request: Request) -> Response:
    from ..doctor import diagnose

    dash = dash_of(request)
    q = await dash.ready()
    computed_at, report = await dash.doctor_report(lambda: diagnose(q))
    return dash.render(request, "doctor.html", page="doctor", report=report,
                       computed_at=computed_at, doctor_ttl=DOCTOR_TTL)


def routes() -> list[Route]:
    return [Route("/", overview, methods=["GET"]),
            Route("/jobs", jobs, methods=["GET"]),
            Route("/jobs/{job_id}", job, methods=["GET"]),
            Route("/schedules", schedules, methods=["GET"]),
            Route("/doctor", doctor, methods=["GET"])]
