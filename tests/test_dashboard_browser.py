"""The dashboard in a real browser (Chromium through Playwright): the overview follows a live
worker without a reload, a failed job is opened and retried until done, and hostile user data
renders as text (no dialog ever opens). Each page's screenshot goes to $DASHBOARD_SCREENSHOTS
when set (docs/img holds the docs' and README's), else to the test's tmp_path."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from conftest import running, wait_for

from asyncjobq import Job, Queue, Worker

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(f"{CHROMIUM} is missing: the dashboard's browser tests need Chromium "
                "(apt-get install chromium; .ci/run does it as root)", allow_module_level=True)
playwright_api = pytest.importorskip(
    "playwright.async_api", reason="playwright is missing: pip install -e '.[dev]'")
uvicorn = pytest.importorskip("uvicorn", reason="uvicorn is missing: pip install -e '.[dev]'")

from asyncjobq.dashboard import _state, create_app  # noqa: E402

HOSTILE = "<script>alert('payload')</script>"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest_asyncio.fixture(loop_scope="function")
async def served(queue: Queue, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    """The dashboard served by uvicorn in this event loop (the queue's pool belongs to it)."""
    monkeypatch.setattr(_state, "REFRESH_SECONDS", 1)
    monkeypatch.setattr(_state, "OVERVIEW_TTL", 0.2)
    port = _free_port()
    app = create_app(queue, allowed_hosts=["127.0.0.1"])  # as the CLI does: Host checked
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())
    await wait_for(lambda: server.started or task.done(), timeout=20, what="uvicorn start")
    if task.done():
        task.result()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=20)


@pytest_asyncio.fixture(loop_scope="function")
async def page(tmp_path: Path) -> AsyncIterator[Any]:
    async with playwright_api.async_playwright() as p:
        browser = await p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                          args=["--no-sandbox"])
        context = await browser.new_context(viewport={"width": 1000, "height": 640})
        pg = await context.new_page()
        pg.dialogs = []  # every dialog that opens: script that ran

        async def on_dialog(dialog: Any) -> None:
            pg.dialogs.append(dialog.message)
            await dialog.dismiss()

        pg.on("dialog", on_dialog)
        pg.console = []  # what the page logged: a blocked script or style shows here
        pg.on("console", lambda message: pg.console.append(message.text))
        try:
            yield pg
        finally:
            await browser.close()


def shots(tmp_path: Path) -> Path:
    target = Path(os.environ.get("DASHBOARD_SCREENSHOTS") or tmp_path)
    target.mkdir(parents=True, exist_ok=True)
    return target


async def count(page: Any, queue_name: str, status: str) -> int:
    cell = page.locator(f'a.count[data-queue="{queue_name}"][data-status="{status}"]')
    return int(await cell.inner_text())


async def test_overview_follows_a_live_worker(queue: Queue, served: str, page: Any,
                                              tmp_path: Path) -> None:
    @queue.task(name="dash.step")
    async def step(job: Job) -> None:
        await asyncio.sleep(0.01)

    await queue.enqueue_many("dash.step", [{"i": i} for i in range(300)])
    await page.goto(served + "/")
    assert await count(page, "default", "queued") == 300
    async with running(Worker(queue, concurrency=2, poll_interval=0.2, shutdown_timeout=5)):
        # No reload: the page's own refresh must show the counts moving, then settled.
        async def moving() -> bool:
            return 0 < await count(page, "default", "done") < 300

        await wait_for(moving, timeout=30, interval=0.05, what="the done count to move")
        await page.screenshot(path=str(shots(tmp_path) / "overview.png"))

        async def drained() -> bool:
            return (await count(page, "default", "done") == 300
                    and await count(page, "default", "queued") == 0)

        await wait_for(drained, timeout=60, interval=0.1, what="the page to show all done")
        assert "Workers seen" in await page.content()
        await page.screenshot(path=str(shots(tmp_path) / "overview.png"))
    assert page.dialogs == []
    # The Content-Security-Policy lets the app's own script (the refresh above) and style run.
    assert not [m for m in page.console if "Content Security Policy" in m], page.console
    assert await page.evaluate("document.styleSheets.length") == 1
    assert await page.evaluate("document.styleSheets[0].cssRules.length") > 0


async def test_open_a_failed_job_retry_it_and_see_it_done(queue: Queue, served: str,
                                                          page: Any, tmp_path: Path) -> None:
    broken = {"on": True}

    @queue.task(name="dash.flaky", max_attempts=1)
    async def flaky(job: Job) -> None:
        if broken["on"]:
            raise RuntimeError(f"upstream said {HOSTILE}")

    job_id = await flaky.enqueue({"note": HOSTILE, "items": [1, 2, 3]})
    queue.periodic("dash.flaky", every=3600, name="hourly-flaky")
    async with running(Worker(queue, concurrency=2, poll_interval=0.2, shutdown_timeout=5)):
        async def failed() -> bool:
            info = await queue.get(job_id)
            return info is not None and info.status == "failed"

        await wait_for(failed, timeout=30, what="the job to fail")
        await page.goto(served + "/jobs?status=failed")
        await page.screenshot(path=str(shots(tmp_path) / "jobs.png"))
        await page.click(f'a[href="/jobs/{job_id}"]')
        await page.wait_for_url(f"**/jobs/{job_id}")
        error = await page.locator("pre.err").first.inner_text()
        assert f"RuntimeError: upstream said {HOSTILE}" in error  # the text, shown as text
        assert await page.locator("h3.attempt").all_inner_texts() == ["attempt 1"]
        assert HOSTILE in await page.locator("pre.payload").inner_text()
        await page.screenshot(path=str(shots(tmp_path) / "job.png"))

        broken["on"] = False
        await page.click("button:has-text('Retry')")
        await page.wait_for_selector("text=Job requeued.")

        async def shown_done() -> bool:
            await page.reload()
            return await page.locator("h1 .st").inner_text() == "done"

        await wait_for(shown_done, timeout=30, interval=0.2, what="the page to show done")
    assert page.dialogs == []

    await page.goto(served + "/schedules")
    assert "hourly-flaky" in await page.content()
    await page.screenshot(path=str(shots(tmp_path) / "schedules.png"))
    await page.goto(served + "/doctor")
    await page.wait_for_selector("table.grid")
    await page.screenshot(path=str(shots(tmp_path) / "doctor.png"))
    assert page.dialogs == []
    # The listener itself: a script that does run is seen.
    await page.evaluate("alert('control')")
    assert page.dialogs == ["control"]
