"""The dashboard's routes through an ASGI client against real PostgreSQL: pages, escaping,
auth, CSRF, read-only mode, keyset pages, bad input, actions, the CLI command."""

from __future__ import annotations

import html
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from conftest import TESTS, WorkerProcess, execute, fetchval, wait_for
from markupsafe import escape
from starlette.applications import Starlette
from starlette.routing import Mount

from asyncjobq import Queue
from asyncjobq.dashboard import create_app

HOSTILE = "<script>alert('x')</script>"
HOSTILE_ERROR = "<img src=x onerror=alert(1)> & boom"


@asynccontextmanager
async def client(app: Any, base: str = "http://dash.test") -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url=base) as c:
        yield c


def token_in(page: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert found, "no CSRF field in the page"
    return found.group(1)


def hidden_fields(page: str) -> dict[str, str]:
    """The hidden inputs of the page's (first) form, as the browser would post them."""
    return {html.unescape(n): html.unescape(v) for n, v in
            re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', page)}


async def failed_job(queue: Queue, task: str = "t.fail", error: str = HOSTILE_ERROR,
                     queue_name: str = "default", payload: dict[str, Any] | None = None) -> int:
    job_id = await queue.enqueue(task, payload or {"n": 1}, queue=queue_name)
    await execute(queue, "UPDATE {s}.jobs SET status = 'failed', attempts = 3, "
                         "last_error = %s, finished_at = now() WHERE id = %s", error, job_id)
    return job_id


async def test_every_page_renders(queue: Queue) -> None:
    job_id = await queue.enqueue("t.a", {"k": [1, 2]}, queue="emails")
    await failed_job(queue)
    await queue.pause("emails")
    async with client(create_app(queue)) as c:
        for path in ("/", "/jobs", "/jobs?status=failed", f"/jobs/{job_id}", "/schedules",
                     "/doctor", "/static/dash.css", "/static/dash.js"):
            r = await c.get(path)
            assert r.status_code == 200, (path, r.text[:300])
        overview = (await c.get("/")).text
        assert "emails" in overview and "paused" in overview
        assert 'data-queue="emails" data-status="queued">1<' in overview
        assert "<svg" in overview and "no worker leads" in overview
        detail = (await c.get(f"/jobs/{job_id}")).text
        assert '&#34;k&#34;: [\n    1,\n    2\n  ]' in detail  # pretty-printed, escaped


async def test_user_data_renders_as_text(queue: Queue) -> None:
    job_id = await failed_job(queue, task=f"task{HOSTILE}", queue_name=f"q{HOSTILE}",
                              payload={"html": HOSTILE})
    async with client(create_app(queue)) as c:
        pages = [(await c.get(p)).text for p in
                 ("/", "/jobs", f"/jobs/{job_id}", "/jobs?status=failed")]
        for page in pages:
            assert "<script>alert" not in page
            assert "<img src=x" not in page
        detail = pages[2]
        assert str(escape(HOSTILE)) in detail  # the task name and the payload, as text
        assert str(escape(HOSTILE_ERROR)) in detail
        r = await c.get("/jobs", params={"task": HOSTILE, "queue": HOSTILE})
        assert "<script>alert" not in r.text
        # A flow-control key (enqueue(key=)) is user data too.
        keyed = await queue.enqueue("t.keyed", {}, key=f"account:{HOSTILE}")
        page = (await c.get(f"/jobs/{keyed}")).text
        assert f"account:{escape(HOSTILE)}" in page and "<script>alert" not in page


async def test_auth_is_asked_for_every_request_and_assets(queue: Queue) -> None:
    seen: list[str] = []

    async def deny(request: Any) -> bool:
        seen.append(request.url.path)
        return request.headers.get("x-key") == "ok"

    async with client(create_app(queue, auth=deny)) as c:
        for path in ("/", "/jobs", "/static/dash.css", "/doctor"):
            assert (await c.get(path)).status_code == 403, path
        assert (await c.post("/pause", data={"queue": "default"})).status_code == 403
        assert (await c.get("/", headers={"x-key": "ok"})).status_code == 200
    assert "/static/dash.css" in seen and "/pause" in seen
    assert await queue.paused() == {}

    def broken(request: Any) -> bool:
        raise RuntimeError("auth backend down")

    async with client(create_app(queue, auth=broken)) as c:
        r = await c.get("/")
        assert r.status_code == 403 and "auth backend down" not in r.text
    async with client(create_app(queue, auth=lambda r: True)) as c:
        assert (await c.get("/")).status_code == 200


async def test_actions_need_the_csrf_token_and_a_same_site_request(queue: Queue) -> None:
    job_id = await queue.enqueue("t.a", {})
    app = create_app(queue)
    async with client(app) as c:
        token = token_in((await c.get("/")).text)
        path = f"/jobs/{job_id}/cancel"
        assert (await c.post(path)).status_code == 403  # no token
        assert (await c.post(path, data={"csrf_token": "nope"})).status_code == 403
        r = await c.post(path, data={"csrf_token": token}, headers={"origin": "https://evil.example"})
        assert r.status_code == 403 and "another site" in r.text
        r = await c.post(path, data={"csrf_token": token}, headers={"sec-fetch-site": "cross-site"})
        assert r.status_code == 403
        assert (await queue.get(job_id)).status == "queued"  # type: ignore[union-attr]
    # A cookie planted by someone else (unsigned), repeated in the form: refused.
    async with client(app) as c:
        c.cookies.set("asyncjobq_csrf", "abc.def")
        r = await c.post(path, data={"csrf_token": "abc.def"})
        assert r.status_code == 403
    # The page's own form: accepted, from the same origin too.
    async with client(app) as c:
        token = token_in((await c.get(f"/jobs/{job_id}")).text)
        r = await c.post(path, data={"csrf_token": token}, headers={"origin": "http://dash.test"})
        assert r.status_code == 303 and r.headers["location"] == f"/jobs/{job_id}?note=cancelled"
        assert (await queue.get(job_id)).status == "cancelled"  # type: ignore[union-attr]
        assert "Job cancelled." in (await c.get(r.headers["location"])).text
        # Behind a proxy that rewrote Host, the forwarded one counts.
        other = await queue.enqueue("t.a", {})
        r = await c.post(f"/jobs/{other}/cancel", data={"csrf_token": token},
                         headers={"origin": "https://jobs.example.com", "host": "10.0.0.5:8080",
                                  "x-forwarded-host": "jobs.example.com"})
        assert r.status_code == 303
    # A token from another app (another secret) is refused.
    async with client(create_app(queue)) as c:
        c.cookies.set("asyncjobq_csrf", token)
        assert (await c.post(path, data={"csrf_token": token})).status_code == 403


TOKEN_COOKIE = re.compile(r"asyncjobq_csrf=([0-9a-f]{32}\.[0-9a-f]{64});")
# Cookies a sibling subdomain could plant: non-ASCII (compare_digest raises TypeError on a
# non-ASCII str, which was a 500 on every page), token-shaped around non-ASCII, wrong length,
# empty, very long.
HOSTILE_TOKENS = ["é" * 43, "\u2603", "a.é", f"{'0' * 32}.{'é' * 64}", "\u2603.\u2603",
                  f"{'0' * 32}.{'0' * 63}", "abc.def", "", "a" * 5000 + "." + "b" * 5000]


async def test_hostile_csrf_cookie_or_field_is_refused_never_a_500(queue: Queue) -> None:
    job_id = await queue.enqueue("t.a", {})
    app = create_app(queue)
    path = f"/jobs/{job_id}/cancel"
    for hostile in HOSTILE_TOKENS:
        planted = {"cookie": f"asyncjobq_csrf={hostile}".encode()}
        async with client(app) as c:
            for page in ("/", "/jobs", f"/jobs/{job_id}", "/schedules"):
                r = await c.get(page, headers=planted)
                assert r.status_code == 200, (hostile[:20], page, r.text[:300])
                fresh = TOKEN_COOKIE.search(r.headers.get("set-cookie", ""))
                assert fresh, (hostile[:20], page, r.headers.get("set-cookie"))
                if page in ("/", f"/jobs/{job_id}"):  # the pages with forms here
                    assert token_in(r.text) == fresh.group(1)
            # The hostile value as cookie and field, and each beside a good other half.
            good = token_in((await c.get("/")).text)
            for cookie, field in ((hostile, hostile), (hostile, good), (good, hostile)):
                r = await c.post(path, data={"csrf_token": field},
                                 headers={"cookie": f"asyncjobq_csrf={cookie}".encode()})
                assert r.status_code == 403, (hostile[:20], cookie == good, r.text[:300])
    assert (await queue.get(job_id)).status == "queued"  # type: ignore[union-attr]


async def test_csrf_field_decoded_to_a_lone_surrogate_is_refused_not_a_500(
        queue: Queue) -> None:
    """Starlette decodes a multipart form's fields in the charset its Content-Type names:
    `+2AA-` in UTF-7 is a lone surrogate, which str.encode refuses. The field's shape is
    checked first (_security.py, TOKEN_SHAPE), so it is a 403 like any other forged field."""
    job_id = await queue.enqueue("t.a", {})
    boundary = "asyncjobq-boundary"
    body = (f"--{boundary}\r\n"
            'Content-Disposition: form-data; name="csrf_token"\r\n'
            "Content-Type: text/plain; charset=utf-7\r\n\r\n"
            f"+2AA-\r\n--{boundary}--\r\n").encode()
    async with client(create_app(queue)) as c:
        good = token_in((await c.get("/")).text)
        r = await c.post(f"/jobs/{job_id}/cancel", content=body, headers={
            "content-type": f"multipart/form-data; charset=utf-7; boundary={boundary}",
            "cookie": f"asyncjobq_csrf={good}"})
        assert r.status_code == 403, r.text[:300]
        assert "CSRF token does not match" in r.text
    assert (await queue.get(job_id)).status == "queued"  # type: ignore[union-attr]


async def test_read_only_has_no_action_routes(queue: Queue) -> None:
    failed = await failed_job(queue)
    queued = await queue.enqueue("t.a", {})
    async with client(create_app(queue, read_only=True)) as c:
        pages = [(await c.get(p)).text for p in ("/", f"/jobs/{failed}", f"/jobs/{queued}",
                                                   "/jobs?status=failed")]
        for page in pages:
            assert 'method="post"' not in page
            assert "read-only" in page
        token = "x"
        for path in (f"/jobs/{failed}/retry", f"/jobs/{queued}/cancel", "/bulk", "/pause",
                     "/resume", "/"):
            r = await c.post(path, data={"csrf_token": token, "queue": "default",
                                         "action": "retry"})
            assert r.status_code in (404, 405), (path, r.status_code)
        assert (await c.get("/bulk", params={"action": "retry"})).status_code == 404
    assert (await queue.get(failed)).status == "failed"  # type: ignore[union-attr]
    assert (await queue.get(queued)).status == "queued"  # type: ignore[union-attr]
    assert await queue.paused() == {}


async def test_keyset_pages_cover_live_and_finished_jobs_once(queue: Queue) -> None:
    ids = await queue.enqueue_many("t.keep", [{"i": i} for i in range(70)], queue="a")
    ids += await queue.enqueue_many("t.drop", [{"i": i} for i in range(60)], queue="b")
    assert await queue.cancel_queued(task="t.drop") == 60
    async with client(create_app(queue)) as c:
        seen: list[int] = []
        url: str | None = "/jobs"
        while url:
            page = (await c.get(url)).text
            seen += [int(x) for x in re.findall(r'<td class="num"><a href="/jobs/(\d+)">', page)]
            nxt = re.search(r'<a rel="next" href="([^"]+)"', page)
            url = html.unescape(nxt.group(1)) if nxt else None
        assert seen == sorted(ids, reverse=True)
        # Filters, across the live table and history.
        cancelled = (await c.get("/jobs", params={"status": "cancelled", "queue": "b"})).text
        assert cancelled.count("st-cancelled") == 50 and 'rel="next"' in cancelled
    page = await queue.list_jobs(task="t.drop", status="cancelled", limit=25)
    assert [j.id for j in page.jobs] == sorted(ids[70:], reverse=True)[:25]
    rest = await queue.list_jobs(task="t.drop", before=page.next_before, limit=100)
    assert len(rest.jobs) == 35 and rest.next_before is None
    assert await queue.count_jobs(queue="a", status="queued") == 70
    assert await queue.count_jobs(status="cancelled") == 60
    assert await queue.count_jobs(task="t.drop", status="cancelled") == 60
    assert (await queue.list_jobs(queue="nowhere")).jobs == []


@pytest.mark.parametrize("path, says", [
    ("/jobs?status=bogus", "status=&#39;bogus&#39;: use one of"),
    ("/jobs?before=abc", "before=&#39;abc&#39;: use a job id"),
    ("/jobs?before=-5", "use a job id"),
    ("/jobs?id=12x", "id=&#39;12x&#39;: use a job id"),
    ("/jobs?queue=a%00b", "without NUL"),
    (f"/jobs?task={'t' * 300}", "at most 200 characters"),
    ("/jobs/abc", "is not a job id"),
    ("/jobs/99999999999999999999", "is not a job id"),
])
async def test_bad_input_gets_a_message_not_a_traceback(queue: Queue, path: str,
                                                        says: str) -> None:
    async with client(create_app(queue)) as c:
        r = await c.get(path)
    assert r.status_code == 400, r.text
    assert says in r.text and "Traceback" not in r.text


async def test_unknown_job_and_a_database_in_trouble(queue: Queue, pg_dsn: str) -> None:
    async with client(create_app(queue)) as c:
        r = await c.get("/jobs/424242")
        assert r.status_code == 404 and "no job 424242" in r.text
        assert (await c.get("/jobs?id=424242")).headers["location"] == "/jobs/424242"
    uninstalled = Queue(pg_dsn, schema="t_never_installed_dash")
    async with uninstalled, client(create_app(uninstalled)) as c:
        r = await c.get("/jobs")
        assert r.status_code == 503 and "Traceback" not in r.text
        assert "is not installed" in r.text and "asyncjobq install" in r.text


async def test_retry_bulk_and_pause_from_the_pages(queue: Queue) -> None:
    one = await failed_job(queue, task="t.x")
    others = [await failed_job(queue, task="t.y") for _ in range(3)]
    waiting = await queue.enqueue_many("t.z", [{}] * 4, queue="slow")
    async with client(create_app(queue)) as c:
        detail = (await c.get(f"/jobs/{one}")).text
        assert f'action="/jobs/{one}/retry"' in detail
        r = await c.post(f"/jobs/{one}/retry", data={"csrf_token": token_in(detail)})
        assert r.status_code == 303 and "Job requeued." in (await c.get(r.headers["location"])).text
        assert (await queue.get(one)).status == "queued"  # type: ignore[union-attr]

        listing = (await c.get("/jobs", params={"status": "failed"})).text
        assert "Retry all matching" in listing
        preview = (await c.get("/bulk", params={"action": "retry", "task": "t.y"})).text
        assert 'data-count="3"' in preview
        r = await c.post("/bulk", data=hidden_fields(preview))
        assert r.status_code == 303
        assert "Requeued 3 failed job(s)." in (await c.get(r.headers["location"])).text
        assert {(await queue.get(i)).status for i in others} == {"queued"}  # type: ignore[union-attr]

        preview = (await c.get("/bulk", params={"action": "cancel", "queue": "slow"})).text
        assert 'data-count="4"' in preview
        assert hidden_fields(preview)["queue"] == "slow"
        r = await c.post("/bulk", data=hidden_fields(preview))
        assert "Cancelled 4 queued job(s)." in (await c.get(r.headers["location"])).text
        assert {(await queue.get(i)).status for i in waiting} == {"cancelled"}  # type: ignore[union-attr]
        r = await c.get("/bulk", params={"action": "delete"})
        assert r.status_code == 400 and "use retry" in r.text

        token = token_in((await c.get("/")).text)
        r = await c.post("/pause", data={"csrf_token": token, "queue": "default"})
        assert r.status_code == 303 and "default" in await queue.paused()
        assert "Resume" in (await c.get("/")).text
        await c.post("/resume", data={"csrf_token": token, "queue": "default"})
        assert await queue.paused() == {}
        r = await c.post("/pause", data={"csrf_token": token, "queue": ""})
        assert r.status_code == 400


async def test_base_path_prefixes_routes_and_links(queue: Queue) -> None:
    async with client(create_app(queue, base_path="/ops/jobs")) as c:
        r = await c.get("/ops/jobs/")
        assert r.status_code == 200
        assert 'href="/ops/jobs/jobs"' in r.text and 'href="/ops/jobs/static/dash.css"' in r.text
        assert "path=/ops/jobs/" in r.headers["set-cookie"].lower()
        assert (await c.get("/ops/jobs/static/dash.js")).status_code == 200
    outer = Starlette(routes=[Mount("/outer", create_app(queue, base_path="/in"))])
    async with client(outer) as c:
        r = await c.get("/outer/in/jobs")
        assert r.status_code == 200 and 'href="/outer/in/static/dash.css"' in r.text
    with pytest.raises(ValueError, match="base_path"):
        create_app(queue, base_path="ops/")


@pytest.mark.processes
def test_without_the_extra_import_and_cli_say_what_to_install() -> None:
    block = "import sys; sys.modules['starlette'] = None; "
    r = subprocess.run([sys.executable, "-c", block + "import asyncjobq.dashboard"],
                       capture_output=True, text=True, timeout=60)
    assert "ExtraNotInstalledError" in r.stderr
    assert "pip install 'asyncjobq[dashboard]'" in r.stderr
    r = subprocess.run([sys.executable, "-c", block + "from asyncjobq.cli import main; "
                        "main(['dashboard', 'apps.testapp:queue'])"],
                       capture_output=True, text=True, timeout=60, cwd=TESTS)
    assert r.returncode == 1
    assert r.stderr.strip() == ("asyncjobq: error: the dashboard needs the dashboard extra: pip "
                                "install 'asyncjobq[dashboard]' (starlette, jinja2, "
                                "python-multipart; uvicorn to serve it alone)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("host, warns", [("127.0.0.1", False), ("0.0.0.0", True)])
@pytest.mark.processes
async def test_the_cli_serves_it_and_warns_off_loopback(queue: Queue, pg_dsn: str, host: str,
                                                        warns: bool) -> None:
    port = _free_port()
    env = {**os.environ, "ASYNCJOBQ_DSN": pg_dsn, "ASYNCJOBQ_TEST_SCHEMA": queue.schema,
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = WorkerProcess([sys.executable, "-m", "asyncjobq", "dashboard", "apps.testapp:queue",
                          "--host", host, "--port", str(port), "--read-only",
                          "--log-level", "warning"], cwd=TESTS, env=env)
    try:
        async def up() -> bool:
            assert proc.poll() is None, proc.stderr_so_far()
            try:
                async with httpx.AsyncClient() as c:
                    return (await c.get(f"http://127.0.0.1:{port}/")).status_code == 200
            except httpx.TransportError:
                return False

        await wait_for(up, timeout=30, interval=0.1, what="the dashboard command to serve")
        async with httpx.AsyncClient() as c:
            url = f"http://127.0.0.1:{port}/"
            for name, status in (("evil.example", 400), (f"evil.example:{port}", 400),
                                 (f"localhost:{port}", 200), (f"[::1]:{port}", 200)):
                r = await c.get(url, headers={"host": name})
                assert r.status_code == status, (name, r.status_code)
                assert r.headers["x-frame-options"] == "DENY"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert ("has no authentication" in err) is warns, err
    assert f"http://{host}:{port}/ (read-only)" in err
    assert "another Host than localhost, 127.0.0.1, [::1]" in err


def test_chart_buckets_minutes() -> None:
    from datetime import UTC, datetime, timedelta

    from asyncjobq.dashboard._chart import throughput_chart

    now = datetime(2026, 1, 1, 12, 30, 20, tzinfo=UTC)
    rows = [(now.replace(second=0) - timedelta(minutes=1), "a", "done", 6),
            (now.replace(second=0), "a", "failed", 2),
            (now - timedelta(hours=2), "a", "done", 99)]
    chart = throughput_chart(rows, now=now)
    assert (chart.total_done, chart.total_failed, chart.peak) == (6, 2, 6)
    assert chart.bars[-2].title == "12:29 UTC: 6 done, 0 failed"
    assert chart.bars[-1].failed_h > 0 and chart.bars[0].done_h == 0




def test_attempt_errors_are_split_back_per_attempt() -> None:
    from asyncjobq.dashboard._pages import attempt_errors

    text = "attempt 1: ValueError: a\nline two\nattempt 2: Timeout\nattempt 3: KeyError: 'x'"
    assert attempt_errors(text) == [("attempt 1", "ValueError: a\nline two"),
                                    ("attempt 2", "Timeout"), ("attempt 3", "KeyError: 'x'")]
    assert attempt_errors("t of a cut one\nattempt 9: boom") == [
        ("earlier", "t of a cut one"), ("attempt 9", "boom")]
    assert attempt_errors("set by hand") == [("error", "set by hand")]
    assert attempt_errors(None) == []


async def test_the_readme_example_mounts_it_behind_auth(queue: Queue, pg_dsn: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from asgi_lifespan import LifespanManager
    from test_readme import load_example

    monkeypatch.setenv("ASYNCJOBQ_DSN", pg_dsn)
    monkeypatch.setenv("QUEUE_SCHEMA", queue.schema)
    monkeypatch.setenv("STAFF_EMAILS", "ana@example.com,bo@example.com")
    example = load_example("dashboard_app", monkeypatch)
    job_id = await queue.enqueue("t.a", {})
    async with LifespanManager(example.app) as manager, client(manager.app) as c:
        assert (await c.get("/admin/jobs/")).status_code == 403
        assert (await c.get("/admin/jobs/static/dash.css",
                            headers={"x-forwarded-email": "eve@example.com"})).status_code == 403
        staff = {"x-forwarded-email": "bo@example.com"}
        r = await c.get(f"/admin/jobs/jobs/{job_id}", headers=staff)
        assert r.status_code == 200 and 'href="/admin/jobs/jobs"' in r.text
    assert not example.queue.database.is_open


async def test_hostile_names_filter_exactly_and_render_as_text(queue: Queue) -> None:
    from test_security import hostile, tables_intact

    await execute(queue, "CREATE TABLE {s}.canary (x int); INSERT INTO {s}.canary VALUES (1)")
    names = hostile(queue.schema)
    ids = {name: await queue.enqueue(name, {name: name}, queue=name) for name in names}
    async with client(create_app(queue)) as c:
        for name in names:
            page = await queue.list_jobs(queue=name, task=name)
            assert [j.id for j in page.jobs] == [ids[name]], name
            assert await queue.count_jobs(queue=name, task=name, status="queued") == 1
            r = await c.get("/jobs", params={"queue": name, "task": name})
            assert r.status_code == 200, (name, r.text[:300])
            assert f'href="/jobs/{ids[name]}"' in r.text and str(escape(name)) in r.text
        assert await queue.cancel_queued(queue=names[0], task=names[0]) == 1
        assert await queue.count_jobs(status="queued") == len(names) - 1
    await tables_intact(queue)


async def test_it_starts_without_its_database_and_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    from asgi_lifespan import LifespanManager

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = Queue(f"postgresql://postgres@127.0.0.1:{port}/postgres", connect_timeout=1,
                 schema="nowhere")
    async with LifespanManager(create_app(down)) as manager, client(manager.app) as c:
        r = await c.get("/")
        assert r.status_code == 503 and "Traceback" not in r.text
        assert "Unavailable" in r.text
    assert "cannot open the queue yet" in caplog.text


# --- the review's findings ----------------------------------------------------------------

async def test_a_host_not_allowed_is_refused_before_anything_runs(queue: Queue) -> None:
    """DNS rebinding: a page at http://evil.example:8080 whose name resolves to the dashboard's
    address sends Host (and Origin) evil.example; Origin matches Host, so only the Host check
    stops it reading pages and posting actions."""
    job_id = await queue.enqueue("t.a", {})
    asked: list[str] = []

    def auth(request: Any) -> bool:
        asked.append(request.headers["host"])
        return True

    app = create_app(queue, auth=auth, allowed_hosts=["dash.test", "::1", "*.corp.example"])
    async with client(app) as c:
        token = token_in((await c.get(f"/jobs/{job_id}")).text)
        evil = {"host": "evil.example:8080", "origin": "http://evil.example:8080"}
        for path in ("/", "/jobs", f"/jobs/{job_id}", "/doctor", "/static/dash.js"):
            r = await c.get(path, headers=evil)
            assert r.status_code == 400, (path, r.status_code)
            assert "Invalid host header" in r.text
        for path, data in ((f"/jobs/{job_id}/cancel", {}), ("/pause", {"queue": "default"}),
                           ("/bulk", {"action": "cancel", "max_id": str(job_id),
                                      "count": "1"})):
            r = await c.post(path, data={"csrf_token": token, **data}, headers=evil)
            assert r.status_code == 400, (path, r.status_code)
        assert "evil.example:8080" not in asked  # refused before auth ran
        assert (await queue.get(job_id)).status == "queued"  # type: ignore[union-attr]
        assert await queue.paused() == {}
        for host in ("dash.test:80", "[::1]:8080", "a.corp.example"):
            assert (await c.get("/", headers={"host": host})).status_code == 200, host
        r = await c.post(f"/jobs/{job_id}/cancel", data={"csrf_token": token},
                         headers={"origin": "http://dash.test"})
        assert r.status_code == 303
    for bad in ("localhost", ["localhost:8080"], [], ["a.*.example"], [None]):
        with pytest.raises(ValueError, match="allowed_hosts"):
            create_app(queue, allowed_hosts=bad)  # type: ignore[arg-type]


def test_the_cli_allows_loopback_names_its_host_and_the_ones_given() -> None:
    from asyncjobq.cli import dashboard_hosts

    loop = ["localhost", "127.0.0.1", "[::1]"]
    assert dashboard_hosts("127.0.0.1", ()) == loop
    assert dashboard_hosts("0.0.0.0", ()) == loop
    assert dashboard_hosts("::", ("jobs.example.com",)) == [*loop, "jobs.example.com"]
    assert dashboard_hosts("10.0.0.5", ("a.example", "b.example")) == [
        *loop, "10.0.0.5", "a.example", "b.example"]
    assert dashboard_hosts("fd00::5", ()) == [*loop, "[fd00::5]"]


def assert_secured(r: httpx.Response) -> None:
    assert r.headers.get("x-frame-options") == "DENY", (r.request.url, r.status_code)
    csp = r.headers.get("content-security-policy", "")
    assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp, csp
    assert "default-src 'none'" in csp and "style-src 'self'" in csp, csp


async def test_every_response_forbids_framing_and_foreign_scripts(queue: Queue) -> None:
    await queue.enqueue("t.a", {})  # the overview's queue row has the pause form
    async with client(create_app(queue, allowed_hosts=["dash.test"])) as c:
        token = token_in((await c.get("/")).text)
        responses = [await c.get(p) for p in ("/", "/jobs", "/static/dash.css", "/doctor",
                                             "/static/nope", "/jobs/abc", "/jobs/424242")]
        responses.append(await c.get("/", headers={"host": "evil.example"}))  # 400
        responses.append(await c.post("/pause", data={"queue": "x"}))  # 403, no token
        responses.append(await c.post("/pause", data={"csrf_token": token, "queue": "q"},
                                      headers={"origin": "http://dash.test"}))  # 303
        assert {r.status_code for r in responses} >= {200, 303, 400, 403, 404}
        for r in responses:
            assert_secured(r)
    async with client(create_app(queue, auth=lambda r: False)) as c:
        assert_secured(await c.get("/"))  # the auth gate's 403 too


@pytest.mark.parametrize("path, says", [
    ("/jobs?id=%C2%B2", "id=&#39;²&#39;: use a job id"),
    ("/jobs/%C2%B2", "&#39;²&#39; is not a job id"),
    ("/jobs/%D9%A3", "is not a job id"),  # ARABIC-INDIC DIGIT THREE: isdigit() too
    (f"/jobs?before={'9' * 5000}", "before=&#39;9999"),
    (f"/jobs/{'9' * 5000}", "is not a job id"),
    ("/jobs?before=9223372036854775808", "use a job id"),
    ("/jobs?note=bulk-cancelled&n=%C2%B2", "n=&#39;²&#39;: use a whole number"),
    (f"/jobs?note=bulk-cancelled&n={'9' * 5000}", "n=&#39;9999"),
    ("/?note=bulk-retried&n=3&of=%C2%B9", "of=&#39;¹&#39;: use a whole number"),
])
async def test_odd_numbers_get_a_400_not_a_500(queue: Queue, path: str, says: str) -> None:
    async with client(create_app(queue)) as c:
        r = await c.get(path)
    assert r.status_code == 400, r.text[:300]
    assert says in r.text and "Traceback" not in r.text
    assert len(r.text) < 20_000  # the 5000 digits are not echoed back


async def test_odd_ids_in_action_paths_get_a_400(queue: Queue) -> None:
    await queue.enqueue("t.a", {})  # the overview's queue row has the pause form
    async with client(create_app(queue)) as c:
        token = token_in((await c.get("/")).text)
        for path in ("/jobs/%C2%B2/cancel", "/jobs/%C2%B2/retry", f"/jobs/{'9' * 5000}/retry"):
            r = await c.post(path, data={"csrf_token": token})
            assert r.status_code == 400 and "is not a job id" in r.text, (path, r.text[:200])
        assert "Cancelled 0 queued job(s)." in (await c.get("/jobs?note=bulk-cancelled&n=0")).text


async def test_a_bulk_action_takes_only_the_jobs_its_preview_counted(queue: Queue) -> None:
    waiting = await queue.enqueue_many("t.z", [{}] * 3, queue="slow")
    failed = [await failed_job(queue, task="t.f") for _ in range(2)]
    async with client(create_app(queue)) as c:
        cancel = (await c.get("/bulk", params={"action": "cancel", "queue": "slow"})).text
        retry = (await c.get("/bulk", params={"action": "retry"})).text
        assert 'data-count="3"' in cancel and 'data-count="2"' in retry
        form = hidden_fields(cancel)
        assert form["max_id"] == str(max(waiting)) and form["count"] == "3"
        # Between the preview and the click: a job is enqueued, another fails.
        late = await queue.enqueue("t.z", {}, queue="slow")
        late_failed = await failed_job(queue, task="t.f")
        r = await c.post("/bulk", data=form)
        assert r.status_code == 303
        page = (await c.get(r.headers["location"])).text
        assert "Cancelled 3 queued job(s). The preview counted 3." in page
        r = await c.post("/bulk", data=hidden_fields(retry))
        assert "Requeued 2 failed job(s)." in (await c.get(r.headers["location"])).text
        # A form without the preview's bound (not from a preview) is refused.
        no_bound = {k: v for k, v in form.items() if k != "max_id"}
        r = await c.post("/bulk", data=no_bound)
        assert r.status_code == 400 and "open the bulk action" in r.text
    assert {(await queue.get(i)).status for i in waiting} == {"cancelled"}  # type: ignore[union-attr]
    assert (await queue.get(late)).status == "queued"  # type: ignore[union-attr]
    assert {(await queue.get(i)).status for i in failed} == {"queued"}  # type: ignore[union-attr]
    assert (await queue.get(late_failed)).status == "failed"  # type: ignore[union-attr]
    assert await queue.count_jobs(status="queued", queue="slow", max_id=late - 1) == 0
    with pytest.raises(ValueError, match="max_id with status"):
        await queue.count_jobs(status="done", max_id=5)


async def _plan(queue: Queue, **filters: Any) -> str:
    from asyncjobq.queue import _browse_filters

    params = _browse_filters(filters.get("queue"), filters.get("status"), filters.get("task"))
    params.update(before=2**63 - 1, limit=51)
    statement = queue.sql.job_page(queue="queue" in filters, task="task" in filters,
                                   statuses=params["statuses"])
    async with queue.connection() as conn:
        cur = await conn.execute(b"EXPLAIN " + statement.as_bytes(conn), params)
        return "\n".join(row[0] for row in await cur.fetchall())


async def test_the_jobs_list_reads_the_live_table_only_for_live_statuses(queue: Queue) -> None:
    await queue.enqueue_many("t.q", [{}] * 2000)
    for _ in range(3):
        await failed_job(queue)
    ids = await queue.enqueue_many("t.c", [{}] * 5)
    assert await queue.cancel_queued(task="t.c") == 5
    await execute(queue, "ANALYZE {s}.jobs")
    for status in ("done", "cancelled"):
        plan = await _plan(queue, status=status)
        assert not re.search(r" on jobs(_[01])? ", plan) and "_pkey" not in plan, plan
    plan = await _plan(queue, status="failed")
    # jobs_0's and jobs_1's own: jobs is partitioned by generation (0013_generations.sql).
    assert "failed_id_idx" in plan and "_pkey" not in plan, plan
    page = await queue.list_jobs(status="cancelled")
    assert [j.id for j in page.jobs] == sorted(ids, reverse=True)
    assert len((await queue.list_jobs(status="failed")).jobs) == 3


async def test_the_list_shows_the_newest_attempts_error(queue: Queue) -> None:
    text = "attempt 1: " + "OLDEST " * 100 + "\nattempt 2: NEWEST boom"
    job_id = await failed_job(queue, error=text)
    (summary,) = (await queue.list_jobs(status="failed")).jobs
    assert summary.id == job_id and summary.last_error is not None
    assert summary.last_error.endswith("attempt 2: NEWEST boom")
    assert len(summary.last_error) == 300
    async with client(create_app(queue)) as c:
        assert "NEWEST boom" in (await c.get("/jobs?status=failed")).text


async def test_the_doctor_runs_once_per_30_s_and_one_at_a_time(
        queue: Queue, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from asyncjobq import doctor
    from asyncjobq.dashboard import _state

    real = doctor.diagnose
    runs = 0

    async def counted(q: Queue) -> Any:
        nonlocal runs
        runs += 1
        await asyncio.sleep(0.2)
        return await real(q)

    monkeypatch.setattr(doctor, "diagnose", counted)
    async with client(create_app(queue)) as c:
        pages = await asyncio.gather(*(c.get("/doctor") for _ in range(4)))
        assert {r.status_code for r in pages} == {200} and runs == 1
        assert "computed at" in pages[0].text
        assert (await c.get("/doctor")).status_code == 200 and runs == 1
        monkeypatch.setattr(_state, "DOCTOR_TTL", 0.0)
        assert (await c.get("/doctor")).status_code == 200 and runs == 2


async def test_retry_that_keeps_racing_raises_a_named_error(
        queue: Queue, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from psycopg import sql

    from asyncjobq import AsyncJobQError, RetryRaceError

    await execute(queue, "CREATE FUNCTION {s}.always_taken(bigint, text) RETURNS int"
                         " LANGUAGE plpgsql AS $$ BEGIN RAISE unique_violation; END $$")
    racing = sql.SQL("SELECT {s}.always_taken(%(id)s, %(channel)s)").format(
        s=sql.Identifier(queue.schema))
    monkeypatch.setattr(Queue, "sql", property(lambda q: SimpleNamespace(job_retry_one=racing)))
    with pytest.raises(RetryRaceError, match=r"retry\(7\) kept racing.*call retry\(\) again"):
        await queue.retry(7)
    assert issubclass(RetryRaceError, AsyncJobQError)


async def test_migration_0008_does_not_deadlock_with_a_completion(queue: Queue,
                                                                  pg_dsn: str) -> None:
    """A completion locks jobs (its DELETE), then jobs_history (its INSERT); 0008 runs in the
    install's one transaction. Building the history indexes first held SHARE on history while
    waiting for jobs: the completion's INSERT then waited on history, a deadlock. 0008 now
    locks jobs first, so the completion finishes and the install goes on after it."""
    import asyncio

    import psycopg

    from asyncjobq._db import migrations

    # 0008's own (a partition's index goes with the partitioned one, 0013_generations.sql).
    names = [n for n, d in migrations.expected_indexes().items()
             if ("browse" in n or n == "jobs_failed_id_idx") and not re.match(r"jobs_[01]_", n)]
    assert len(names) == 4, names
    for name in names:
        await execute(queue, f"DROP INDEX {{s}}.{name}")
    await execute(queue, "DELETE FROM {s}.migrations WHERE version = 8")
    first, second = await queue.enqueue_many("t.a", [{}, {}])
    s = psycopg.sql.Identifier(queue.schema)
    async with await psycopg.AsyncConnection.connect(pg_dsn) as completion, \
            await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as watch:
        await completion.execute("SET lock_timeout = '20s'")
        await completion.execute(psycopg.sql.SQL("DELETE FROM {s}.jobs WHERE id = %s")
                                 .format(s=s), (first,))
        install = asyncio.create_task(queue.install())

        async def install_waits() -> bool:
            assert not install.done(), install.result()
            cur = await watch.execute("SELECT count(*) FROM pg_locks WHERE NOT granted"
                                      " AND database = (SELECT oid FROM pg_database"
                                      "   WHERE datname = current_database())"
                                      " AND relation = %s::regclass", (f"{queue.schema}.jobs",))
            row = await cur.fetchone()
            return bool(row and row[0])

        await wait_for(install_waits, timeout=20, interval=0.05, what="the install to wait")
        # The completion's INSERT into history (with another DELETE, as a cancel does).
        await completion.execute(queue.sql.job_cancel, {
            "id": second, "done": queue.database.done_channel,
            "cancel": queue.database.cancel_channel})
        await completion.commit()
        assert await asyncio.wait_for(install, timeout=30) == [8]
    left = await fetchval(queue, "SELECT array_agg(indexname::text ORDER BY indexname)"
                                 " FROM pg_indexes WHERE schemaname = %s", queue.schema)
    assert set(names) <= set(left)


async def test_a_bulk_action_touches_no_more_jobs_than_its_preview_counted(
        queue: Queue) -> None:
    """A job older than the preview's newest that becomes queued (a backoff) or failed after
    the preview is below max_id: the count caps the action, newest first."""
    older, *queued = await queue.enqueue_many("t.z", [{}] * 3, queue="slow")
    old_failed = await failed_job(queue, task="t.f")
    failed = [await failed_job(queue, task="t.f") for _ in range(2)]
    for job_id in (older, old_failed):  # running while the previews count
        await execute(queue, "UPDATE {s}.jobs SET status = 'running' WHERE id = %s", job_id)
    async with client(create_app(queue)) as c:
        cancel = hidden_fields((await c.get("/bulk", params={"action": "cancel",
                                                            "queue": "slow"})).text)
        retry = hidden_fields((await c.get("/bulk", params={"action": "retry"})).text)
        assert cancel["count"] == "2" and retry["count"] == "2"
        await execute(queue, "UPDATE {s}.jobs SET status = 'queued' WHERE id = %s", older)
        await execute(queue, "UPDATE {s}.jobs SET status = 'failed' WHERE id = %s", old_failed)
        r = await c.post("/bulk", data=cancel)
        assert "Cancelled 2 queued job(s)." in (await c.get(r.headers["location"])).text
        r = await c.post("/bulk", data=retry)
        assert "Requeued 2 failed job(s)." in (await c.get(r.headers["location"])).text
    assert {(await queue.get(i)).status for i in queued} == {"cancelled"}  # type: ignore[union-attr]
    assert (await queue.get(older)).status == "queued"  # type: ignore[union-attr]
    assert {(await queue.get(i)).status for i in failed} == {"queued"}  # type: ignore[union-attr]
    assert (await queue.get(old_failed)).status == "failed"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="limit"):
        await queue.cancel_queued(limit=0)
    assert int(await queue.retry_failed(limit=1)) == 1


async def test_the_job_page_shows_result_and_progress_and_cancels_a_running_job(
        queue: Queue) -> None:
    done = await queue.enqueue("t.a", {})
    await execute(queue, "WITH d AS (DELETE FROM {s}.jobs WHERE id = %s RETURNING *)"
                         " INSERT INTO {s}.jobs_history (id, queue, task, payload, status,"
                         " priority, run_at, attempts, max_attempts, created_at, finished_at,"
                         " result) SELECT id, queue, task, payload, 'done', priority, run_at, 1,"
                         " max_attempts, created_at, now(), %s::jsonb FROM d",
                  done, json.dumps({"html": HOSTILE}))
    run = await queue.enqueue("t.a", {})
    await execute(queue, "UPDATE {s}.jobs SET status = 'running', attempts = 1, locked_by = 'w',"
                         " locked_at = now(), progress = %s::jsonb WHERE id = %s",
                  json.dumps({"step": HOSTILE_ERROR}), run)
    async with client(create_app(queue)) as c:
        page = (await c.get(f"/jobs/{done}")).text
        assert "Result" in page and HOSTILE not in page and "&lt;script&gt;" in page
        page = (await c.get(f"/jobs/{run}")).text
        assert HOSTILE_ERROR not in page and "&lt;img src=x" in page  # the progress, escaped
        r = await c.post(f"/jobs/{run}/cancel", data={"csrf_token": token_in(page)})
        assert r.headers["location"] == f"/jobs/{run}?note=cancel-requested"
        page = (await c.get(r.headers["location"])).text
        assert "Cancel requested" in page and "requested: its worker stops" in page
    info = await queue.get(run)
    assert info is not None and info.status == "running" and info.cancel_requested
