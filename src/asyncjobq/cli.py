"""`python -m asyncjobq`: worker, install, enqueue, status, schedules, retry-failed, cancel,
prune, doctor, dashboard, demo.

Mistakes exit 2 (usage) or 1 (runtime) with one line on stderr that says what to do.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import ipaddress
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import click
import psycopg

from . import runtime
from ._checks import check_queue_name
from ._db import migrations
from ._db.dsn import check_dsn, validate_schema
from .errors import (
    AppImportError,
    AsyncJobQError,
    ConfigurationError,
    ExtraNotInstalledError,
    MetricsPortInUseError,
    a_or_an,
    reason,
)
from .logs import JsonFormatter
from .queue import POOLERS, Queue
from .worker import Worker

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("asyncjobq")


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"asyncjobq: error: {message}", err=True)
    sys.exit(code)


class _AppMistake(ConfigurationError):
    """A mistake in the APP's own set-up (a schedule's expression, timezone or task): a usage
    error, exit 2 with one line."""


def _guard(fn: F) -> F:
    """Our errors and database errors become one line and exit 1 (2 for a mistake in APP's
    set-up), never a traceback."""

    def one_line(e: BaseException) -> str | None:
        if isinstance(e, AsyncJobQError):
            return str(e)
        if isinstance(e, psycopg.Error):
            return f"database error: {reason(e)}"
        return None

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except _AppMistake as e:
            _fail(str(e), 2)
        except AsyncJobQError as e:
            _fail(str(e))
        except psycopg.Error as e:
            _fail(f"database error: {reason(e)}")
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except BaseExceptionGroup as group:
            # The worker's task groups (anyio) wrap what ended them. Our errors and database
            # errors still get one line each; anything else is a bug and keeps its traceback.
            leaves: list[BaseException] = []
            pending: list[BaseException] = [group]
            while pending:
                error = pending.pop(0)
                if isinstance(error, BaseExceptionGroup):
                    pending[:0] = error.exceptions
                else:
                    leaves.append(error)
            if any(isinstance(leaf, KeyboardInterrupt) for leaf in leaves):
                _fail("interrupted", 130)
            lines = [one_line(leaf) for leaf in leaves]
            if any(line is None for line in lines):
                raise
            _fail("; ".join(dict.fromkeys(line for line in lines if line is not None)))

    return wrapper  # type: ignore[return-value]


def _dsn_param(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    # A typo in --dsn is a usage mistake (exit 2), not a connection failure.
    if value:
        try:
            check_dsn(value)
        except ConfigurationError as e:
            raise click.BadParameter(str(e)) from None
    return value


def _schema_param(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    # A schema name that could never be valid is a usage mistake (exit 2).
    try:
        return validate_schema(value)
    except ConfigurationError as e:
        raise click.BadParameter(str(e)) from None


def _queue_param(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    # A queue name that could never be valid is a usage mistake (exit 2).
    try:
        check_queue_name(value)
    except ConfigurationError as e:
        raise click.BadParameter(str(e)) from None
    return value


def _db_options(fn: F) -> F:
    fn = click.option("--schema", default="asyncjobq", show_default=True, callback=_schema_param,
                      help="PostgreSQL schema holding the queue tables.")(fn)
    fn = click.option("--dsn", default=None, metavar="DSN", callback=_dsn_param,
                      help="PostgreSQL DSN; else $ASYNCJOBQ_DSN; else the embedded server.")(fn)
    return fn


def _setup_logging(level: str, log_format: str = "text") -> JsonFormatter | None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    formatter = None
    if log_format == "json":
        formatter = JsonFormatter()
        for handler in logging.root.handlers:
            handler.setFormatter(formatter)
    # pgserver narrates every start of the embedded server at INFO (pg_ctl's argv, its stdout):
    # a page of noise above the worker's first line. asyncjobq says in one line which server
    # it uses; pgserver's warnings and errors still show, and all of it at --log-level debug.
    if logging.root.level > logging.DEBUG:
        logging.getLogger("pgserver").setLevel(logging.WARNING)
    return formatter


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="asyncjobq")
def main() -> None:
    """asyncjobq: an asyncio job queue on PostgreSQL."""


# --- worker ----------------------------------------------------------------------------------


def _app_param(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    module_name, colon, attr = value.partition(":")
    if not colon or not module_name or not attr:
        raise click.BadParameter(
            f"{value!r} is not module:attribute: use e.g. `myapp.jobs:queue`")
    return value


def load_app(app: str) -> Queue:
    if ":" not in app:
        raise AppImportError(
            f"APP {app!r} is not module:attribute: use e.g. `myapp.jobs:queue`")
    module_name, _, attr = app.partition(":")
    if not module_name or not attr:
        raise AppImportError(f"APP {app!r} is not module:attribute: use e.g. `myapp.jobs:queue`")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: the app lives where you are
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise AppImportError(
                f"cannot import {module_name!r} ({e}): run from the directory that contains "
                "it, or add that directory to PYTHONPATH") from None
        raise AppImportError(
            f"importing {module_name!r} failed: {e}: install the missing package or fix the "
            "import in the module") from None
    except ConfigurationError as e:
        # Registration refused a schedule or a task at import: the APP needs fixing.
        raise _AppMistake(f"{app}: {e}") from None
    except Exception as e:
        where = ""
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None:
            where = f" at {Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno}"
        raise AppImportError(
            f"importing {module_name!r} raised {type(e).__name__}: {e}{where}; fix the module"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AppImportError(
                f"{module_name!r} has no attribute {attr!r}: name the asyncjobq.Queue "
                f"object, e.g. `{module_name}:queue`")
        obj = getattr(obj, part)
    if not isinstance(obj, Queue):
        raise AppImportError(
            f"{app} is {a_or_an(type(obj).__name__)}, not an asyncjobq.Queue: point APP at the "
            "object created with asyncjobq.Queue(...)")
    return obj


def load_checked_app(app: str) -> Queue:
    """load_app, then the checks a worker makes at start (every schedule's task registered)."""
    queue = load_app(app)
    try:
        queue.check_schedules()
    except ConfigurationError as e:
        raise _AppMistake(f"{app}: {e}") from None
    return queue


@main.command()
@click.argument("app", callback=_app_param)
@click.option("--queue", "queues", multiple=True, metavar="Q",
              help="Queue to serve (repeatable). Default: default.")
@click.option("--concurrency", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=None,
              help="Most jobs claimed per statement.  [default: 10, or half of `--concurrency` "
                   "up to 100]")
@click.option("--lease", type=click.FloatRange(min=0, min_open=True), default=30.0,
              show_default=True, help="Seconds without heartbeat after which a job is reaped.")
@click.option("--poll-interval", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True)
@click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=30.0,
              show_default=True)
@click.option("--name", default=None, help="Worker name (locked_by prefix).")
@click.option("--no-listen", is_flag=True, help="Poll only; no LISTEN connection.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text",
              show_default=True, help="json: one object per line, with job_id, task, queue, "
              "attempt and worker where they apply.")
@click.option("--dsn", default=None, metavar="DSN", callback=_dsn_param,
              help="PostgreSQL DSN; overrides the app's; else $ASYNCJOBQ_DSN; else embedded.")
@click.option("--pooler", type=click.Choice(POOLERS), default=None,
              help="What --dsn points at: a transaction-mode pooler (PgBouncer), a session "
              "pooler, or PostgreSQL itself.  [default: the app's Queue(pooler=), auto]")
@click.option("--listen-dsn", default=None, metavar="DSN", callback=_dsn_param,
              envvar="ASYNCJOBQ_LISTEN_DSN",
              help="A direct connection to PostgreSQL for LISTEN when --dsn goes through a "
              "transaction pooler; else $ASYNCJOBQ_LISTEN_DSN; without it, such a worker polls.")
@click.option("--metrics-port", type=click.IntRange(min=0, max=65535), default=None,
              metavar="PORT", help="Serve Prometheus metrics at :PORT/metrics "
              "(needs asyncjobq[prometheus]).")
@click.option("--metrics-host", default="0.0.0.0", show_default=True, metavar="ADDR",
              help="Address /metrics listens on (127.0.0.1: this host only).")
@_guard
def worker(app: str, queues: tuple[str, ...], concurrency: int, batch: int | None, lease: float,
           poll_interval: float, shutdown_timeout: float, name: str | None, no_listen: bool,
           log_level: str, log_format: str, dsn: str | None, pooler: str | None,
           listen_dsn: str | None, metrics_port: int | None, metrics_host: str) -> None:
    """Run a worker for APP (module:attribute naming a Queue) until SIGTERM/SIGINT."""
    formatter = _setup_logging(log_level, log_format)
    queue = load_checked_app(app)
    if dsn:
        queue.set_dsn(dsn)
    if pooler is not None or listen_dsn:
        queue.set_pooler(pooler, listen_dsn=listen_dsn)
    if queue.application_name == "asyncjobq":
        # Tells workers from producers in pg_stat_activity.
        queue.application_name = "asyncjobq-worker"
    w = Worker(queue, queues=queues or ("default",), concurrency=concurrency, batch_size=batch,
               lease=lease, poll_interval=poll_interval, shutdown_timeout=shutdown_timeout,
               name=name, listen=not no_listen, metrics_port=metrics_port,
               metrics_host=metrics_host)
    if formatter is not None:
        formatter.worker = w.id
    try:
        runtime.run(_run_worker, w)
    except MetricsPortInUseError as e:
        _fail(str(e), 2)  # a usage mistake: the command line names a port that is taken


async def _run_worker(w: Worker) -> None:
    import asyncio

    loop = asyncio.get_running_loop()
    signals = {"count": 0}

    def on_signal(signum: int) -> None:
        signals["count"] += 1
        if signals["count"] == 1:
            log.info("%s: stopping (send it again to exit at once)", signal.Signals(signum).name)
            w.stop()
        else:
            log.warning("second signal: exiting now; running jobs will be reaped after the lease")
            os._exit(1)

    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, on_signal, s)
    try:
        await w.run()
    finally:
        await w.queue.close()


# --- admin commands ----------------------------------------------------------------------------


def _with_queue(dsn: str | None, schema: str, fn: Callable[[Queue], Any]) -> Any:
    async def go() -> Any:
        async with Queue(dsn, schema=schema) as q:
            return await fn(q)

    return runtime.run(go)


@main.command()
@_db_options
@_guard
def install(dsn: str | None, schema: str) -> None:
    """Create or upgrade the queue schema (idempotent)."""
    applied = _with_queue(dsn, schema, lambda q: q.install())
    if applied:
        click.echo(f"schema {schema}: applied migrations {', '.join(map(str, applied))}")
    else:
        click.echo(f"schema {schema}: up to date")


def _reject_constant(name: str) -> Any:
    raise ValueError(name)


def _parse_payload(_ctx: click.Context, _param: click.Parameter, value: str) -> Any:
    source = "JSON"
    if value == "-" or value.startswith("@"):
        # Large payloads cannot be arguments (Linux caps one at 128 KiB): read a file or stdin.
        path = value[1:]
        source = "stdin" if value == "-" else path
        try:
            value = sys.stdin.read() if value == "-" else Path(path).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise click.BadParameter(
                f"cannot read {path!r} ({e.__class__.__name__}: {e}): pass @FILE naming a "
                "readable UTF-8 file, - for stdin, or the JSON itself") from None
    try:
        payload = json.loads(value, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise click.BadParameter(
            f"{source} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): pass "
            "an object like '{\"to\": \"a@example.com\"}'") from None
    except ValueError as e:
        raise click.BadParameter(
            f"{source} contains {e}, which JSON does not allow: use a finite number, a "
            "string or null") from None
    if not isinstance(payload, dict):
        raise click.BadParameter(
            f"must be a JSON object, got {_json_kind(payload)}: wrap it, e.g. "
            "'{\"value\": ...}'")
    return payload


def _json_kind(value: object) -> str:
    kinds = {list: "an array", str: "a string", int: "a number", float: "a number",
             bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


@main.command()
@click.argument("task")
@click.option("--payload", default="{}", callback=_parse_payload, metavar="JSON",
              show_default=True,
              help="The payload object; @FILE reads it from a file, - from stdin.")
@click.option("--queue", default="default", show_default=True)
@click.option("--priority", type=click.IntRange(-(2**31), 2**31 - 1), default=0,
              show_default=True)
@click.option("--delay", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Seconds before the job may run.")
@click.option("--max-attempts", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--dedup-key", default=None)
@_db_options
@_guard
def enqueue(task: str, payload: dict[str, Any], queue: str, priority: int, delay: float,
            max_attempts: int, dedup_key: str | None, dsn: str | None, schema: str) -> None:
    """Enqueue one TASK job and print its id."""
    job_id = _with_queue(dsn, schema, lambda q: q.enqueue(
        task, payload, queue=queue, priority=priority, delay=delay, max_attempts=max_attempts,
        dedup_key=dedup_key))
    click.echo(job_id)


@main.command()
@click.argument("app", required=False, default=None)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--lease", type=click.FloatRange(min=0, min_open=True), default=30.0,
              show_default=True, help="Running jobs not heartbeated this long count as stale.")
@_db_options
@_guard
def status(app: str | None, as_json: bool, lease: float, dsn: str | None, schema: str) -> None:
    """Per queue: counts by status, oldest queued age, stale running, last-minute throughput,
    paused queues. With APP (module:queue), also its tasks' limits and their use (limits live
    in the code, so only the app knows them); the app's schema is read then."""

    async def gather(q: Queue) -> tuple[dict[str, dict[str, int]], dict[str, Any],
                                        dict[str, Any] | None, dict[str, Any], dict[str, Any],
                                        dict[str, Any]]:
        # Counts read from a schema of another version could be wrong; say so instead.
        async with q.connection() as conn:
            await migrations.check(conn, q.schema)
        return (await q.stats(), await q.health(lease), await q.leader(), await q.last_ticks(),
                await q.paused(), await q.limits())

    if app is not None:
        ctx = click.get_current_context()
        _app_param(ctx, click.Argument(["app"]), app)
        app_queue = load_app(app)
        if (ctx.get_parameter_source("schema") == click.core.ParameterSource.COMMANDLINE
                and schema != app_queue.schema):
            raise click.UsageError(
                f"--schema {schema} but {app} uses schema {app_queue.schema}: status APP reads "
                "the app's schema; drop --schema, or set the schema in the app's Queue(...)")
        if dsn is not None:
            app_queue.set_dsn(dsn)
        schema = app_queue.schema

        async def from_app() -> Any:
            async with app_queue:
                return await gather(app_queue)

        counts, health, leader, ticks, paused, limits = runtime.run(from_app)
    else:
        counts, health, leader, ticks, paused, limits = _with_queue(dsn, schema, gather)
    lead = None if leader is None else {"worker": leader["worker"],
                                        "since": leader["since"].isoformat()}
    last_ticks = {name: _iso(t) for name, t in ticks.items()}
    if as_json:
        click.echo(json.dumps({"schema": schema, "queues": counts, "health": health,
                               "leader": lead, "schedules": last_ticks,
                               "paused": {q: _iso(t) for q, t in paused.items()},
                               "limits": limits}, indent=2, sort_keys=True))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"asyncjobq schema {schema}")
    # A waiting column (workflows) only when some queue has waiting jobs.
    shown = (("waiting",) if any(c.get("waiting") for c in counts.values()) else ()) + (
        "queued", "running", "done", "failed", "cancelled")
    for col in ("queue", *shown, "oldest queued", "stale running", "done/min"):
        table.add_column(col, justify="left" if col == "queue" else "right")
    for name in sorted(counts):
        c, h = counts[name], health.get(name, {})
        age = h.get("oldest_queued_age_s")
        table.add_row(name + (" (paused)" if name in paused else ""),
                      *(str(c.get(s, 0)) for s in shown),
                      "-" if age is None else f"{age:.1f} s", str(h.get("stale_running", 0)),
                      str(h.get("done_last_minute", 0)))
    who = ("leader: none (no worker running)" if lead is None
           else f"leader: {lead['worker']} since {lead['since']}")
    if last_ticks:
        newest = max((t for t in last_ticks.values() if t), default=None)
        who += f"; {len(last_ticks)} schedule(s), latest tick {newest or 'none yet'}"
    idle = sorted(set(paused) - set(counts))
    if idle:
        who += f"; paused without jobs: {', '.join(idle)}"
    table.caption = f"no jobs yet; {who}" if not counts else who
    Console().print(table)
    if limits:
        Console().print(_limits_table(limits))


def _limits_table(limits: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="limits (from the app's code)")
    for col in ("task", "queue", "limits", "running", "keys running", "starts this period"):
        table.add_column(col, justify="left" if col in ("task", "queue", "limits") else "right")
    for name, lim in limits.items():
        said = [f"{k}={lim[k]}" for k in ("concurrency_limit", "key_limit", "rate_limit")
                if lim[k] is not None]
        table.add_row(name, lim["queue"], ", ".join(said), str(lim["running"]),
                      str(lim["keys_running"]) if lim["key_limit"] else "-",
                      str(lim["started_in_period"]) if lim["rate_limit"] else "-")
    return table


def _iso(t: Any) -> str | None:
    return None if t is None else str(t.isoformat())


@main.command()
@click.argument("app", callback=_app_param)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--dsn", default=None, metavar="DSN", callback=_dsn_param,
              help="PostgreSQL DSN; overrides the app's; else $ASYNCJOBQ_DSN; else embedded.")
@_guard
def schedules(app: str, as_json: bool, dsn: str | None) -> None:
    """APP's periodic schedules: task, expression, timezone, last tick enqueued, next tick."""
    queue = load_checked_app(app)
    if dsn:
        queue.set_dsn(dsn)

    async def gather() -> list[dict[str, Any]]:
        async with queue:
            async with queue.connection() as conn:
                await migrations.check(conn, queue.schema)
            return await queue.list_schedules()

    rows = runtime.run(gather)
    if as_json:
        click.echo(json.dumps([{**r, "last_tick": _iso(r["last_tick"]),
                                "next_tick": _iso(r["next_tick"])} for r in rows], indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"asyncjobq schema {queue.schema}: schedules")
    for col in ("name", "task", "expression", "timezone", "last tick", "next tick"):
        table.add_column(col, no_wrap=col != "task")
    for r in rows:
        table.add_row(r["name"], r["task"], r["expression"], r["timezone"],
                      _iso(r["last_tick"]) or "-", _iso(r["next_tick"]) or "never")
    if not rows:
        table.caption = "no schedules: register them with queue.periodic(...) or " \
                        "@queue.task(cron=...)"
    Console().print(table)


@main.command()
@click.argument("queue_name", metavar="QUEUE", callback=_queue_param)
@_db_options
@_guard
def pause(queue_name: str, dsn: str | None, schema: str) -> None:
    """Stop workers from claiming QUEUE's jobs; running ones finish (resume undoes it)."""
    now = _with_queue(dsn, schema, lambda q: q.pause(queue_name))
    click.echo(f"queue {queue_name} paused" if now else f"queue {queue_name} was paused already")


@main.command()
@click.argument("queue_name", metavar="QUEUE", callback=_queue_param)
@_db_options
@_guard
def resume(queue_name: str, dsn: str | None, schema: str) -> None:
    """Let workers claim QUEUE's jobs again."""
    was = _with_queue(dsn, schema, lambda q: q.resume(queue_name))
    click.echo(f"queue {queue_name} resumed" if was else f"queue {queue_name} was not paused")


@main.command("retry-failed")
@click.option("--queue", default=None)
@click.option("--task", default=None)
@click.option("--error-like", default=None, metavar="PATTERN",
              help="SQL LIKE pattern on last_error, e.g. '%Timeout%'.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_db_options
@_guard
def retry_failed(queue: str | None, task: str | None, error_like: str | None, as_json: bool,
                 dsn: str | None, schema: str) -> None:
    """Requeue failed (dead-lettered) jobs with their attempts reset.

    Of failed jobs sharing a dedup_key, only the newest is requeued, and none while a queued or
    running job holds the key: the others stay failed, counted as skipped.
    """
    result = _with_queue(dsn, schema, lambda q: q.retry_failed(queue=queue, task=task,
                                                               error_like=error_like))
    if as_json:
        click.echo(json.dumps({"requeued": result.requeued, "skipped": result.skipped}))
        return
    line = f"requeued {result.requeued} failed job(s)"
    if result.skipped:
        line += (f"; left {result.skipped} failed: another job holds their dedup_key (queued, "
                 "running, or the newest failed one of the key, requeued now); retry them "
                 "once it has finished")
    click.echo(line)


@main.command()
@click.argument("job_id", metavar="ID", type=click.IntRange(min=1))
@_db_options
@_guard
def cancel(job_id: int, dsn: str | None, schema: str) -> None:
    """Cancel a job: a waiting or queued one now (with the jobs that wait for it), a running
    one by its worker (within a second)."""
    async def run(q: Queue) -> tuple[bool, Any]:
        return await q.cancel(job_id), await q.get(job_id)

    ok, info = _with_queue(dsn, schema, run)
    if not ok:
        _fail(f"job {job_id} is not queued or running, nor waiting (unknown or finished): "
              "nothing cancelled")
    if info is not None and info.status == "running":
        click.echo(f"cancel of running job {job_id} requested: its worker stops the handler and "
                   "writes cancelled (`get` shows it)")
    else:
        click.echo(f"cancelled job {job_id}")


@main.command()
@click.argument("job_id", metavar="ID", type=click.IntRange(min=1))
@_db_options
@_guard
def get(job_id: int, dsn: str | None, schema: str) -> None:
    """Show a job as JSON: status, attempts, errors, result, progress, parents and
    children."""
    info = _with_queue(dsn, schema, lambda q: q.get(job_id))
    if info is None:
        _fail(f"job {job_id} not found: it never existed, or it finished longer ago than the "
              "queue's retention and was pruned")
    fields = dataclasses.asdict(info)
    click.echo(json.dumps({k: _iso(v) if isinstance(v, datetime) else v
                           for k, v in fields.items()}, indent=2))


_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class Duration(click.ParamType):  # type: ignore[type-arg]
    """`90`, `45s`, `30m`, `12h`, `7d` or combined (`1d12h`), as seconds."""

    name = "DURATION"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> float:
        if isinstance(value, int | float):
            return float(value)
        text = str(value).strip().lower()
        try:
            total = float(text)
        except ValueError:
            parts = _DURATION_RE.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                self.fail(f"{value!r} is not a duration: use e.g. 90 (seconds), 30m, 12h, 7d "
                          "or 1d12h", param, ctx)
            total = sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
        if not total > 0:
            self.fail(f"{value!r}: use a duration greater than 0", param, ctx)
        return total


def _human(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


@main.command()
@click.option("--older-than", type=Duration(), default=None,
              help="Delete finished jobs older than this (e.g. 7d). Default: the 1-day "
                   "retention workers apply.")
@click.option("--queue", default=None, help="Only this queue.")
@click.option("--failed", is_flag=True,
              help="Also delete failed (dead-lettered) jobs older than `--older-than`.")
@_db_options
@_guard
def prune(older_than: float | None, queue: str | None, failed: bool, dsn: str | None,
          schema: str) -> None:
    """Delete finished (done, cancelled) jobs from history past retention, in small batches."""
    if failed and older_than is None:
        raise click.UsageError("--failed needs --older-than: failed jobs are kept until you say "
                               "how old they must be, e.g. --failed --older-than 30d")
    from rich.console import Console

    console = Console(stderr=True)
    with console.status("pruning in batches of a few thousand rows..."):
        deleted = _with_queue(dsn, schema, lambda q: q.prune(older_than, queue=queue,
                                                             failed=failed))
    kinds = "finished and failed" if failed else "finished"
    age = _human(older_than) if older_than is not None else "the default retention (1d)"
    per_queue = ", ".join(f"{q}={n}" for q, n in sorted(deleted.items()))
    click.echo(f"deleted {sum(deleted.values())} {kinds} job(s) older than {age}"
               + (f": {per_queue}" if per_queue else ""))


_LEVEL_STYLE = {"ok": "green", "warning": "yellow", "problem": "bold red"}


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--lease", type=click.FloatRange(min=0, min_open=True), default=30.0,
              show_default=True, help="Running jobs not heartbeated this long count as stale.")
@click.option("--xmin-age", type=Duration(), default=60.0, show_default=True,
              help="Transactions open longer than this are reported as pinning the xmin horizon.")
@_db_options
@_guard
def doctor(as_json: bool, lease: float, xmin_age: float, dsn: str | None, schema: str) -> None:
    """Health of the queue tables: bloat, vacuum, indexes, the claim's plan, xmin, NOTIFY.

    Exits 1 when a problem is found, so it can gate a deploy or page someone.
    """
    from .doctor import diagnose

    report = _with_queue(dsn, schema, lambda q: diagnose(q, lease=lease, xmin_age=xmin_age))
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2, default=str))
    else:
        _print_doctor(report)
    if not report.healthy:
        sys.exit(1)


def _print_doctor(report: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    tables = Table(title=f"asyncjobq schema {report.schema} (PostgreSQL {report.server_version})")
    tables.add_column("table", no_wrap=True)
    for col in ("live", "dead", "size", "indexes", "last autovacuum", "vacuums"):
        tables.add_column(col, justify="right")
    for t in report.tables:
        tables.add_row(t["table"], str(t["live_tuples"]), str(t["dead_tuples"]),
                       f"{t['table_bytes'] / 1024:.0f} kB", f"{t['indexes_bytes'] / 1024:.0f} kB",
                       str(t["last_autovacuum"] or "never")[:19], str(t["autovacuum_count"]))
    console.print(tables)
    # Findings are sentences with a fix each: one per line reads better than a narrow table.
    for f in report.findings:
        style = _LEVEL_STYLE.get(f.level, "")
        console.print(f"[{style}]{f.level:>7}[/]  {f.check}: {f.message}", highlight=False,
                      soft_wrap=True)
        if f.advice:
            console.print(f"         fix: {f.advice}", highlight=False, soft_wrap=True)
    problems = sum(f.level == "problem" for f in report.findings)
    console.print("healthy" if report.healthy else f"{problems} problem(s) found",
                  style="green" if report.healthy else "bold red")


@main.command()
@click.argument("app", callback=_app_param)
@click.option("--host", default="127.0.0.1", show_default=True, metavar="ADDR",
              help="Address to listen on (loopback: this host only).")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8080, show_default=True)
@click.option("--read-only", is_flag=True, help="Pages only: no retry, cancel, pause or resume.")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="A host name (no port) requests may name in Host, besides localhost, "
                   "127.0.0.1, [::1] and `--host` when it is not a wildcard address; repeat it "
                   "for more; `*.example.com` allows subdomains. Any other Host is refused "
                   "(DNS rebinding).")
@click.option("--dsn", default=None, metavar="DSN", callback=_dsn_param,
              help="PostgreSQL DSN; overrides the app's; else $ASYNCJOBQ_DSN; else embedded.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
@_guard
def dashboard(app: str, host: str, port: int, read_only: bool, allowed_hosts: tuple[str, ...],
              dsn: str | None, log_level: str) -> None:
    """Serve the web dashboard of APP (needs asyncjobq[dashboard]) until Ctrl-C."""
    from .dashboard import INSTALL, create_app

    try:
        import uvicorn
    except ImportError:
        raise ExtraNotInstalledError(INSTALL) from None
    queue = load_app(app)
    if dsn:
        queue.set_dsn(dsn)
    hosts = dashboard_hosts(host, allowed_hosts)
    dash_app = create_app(queue, read_only=read_only, allowed_hosts=hosts)
    if not _loopback(host):
        # The CLI has no way to pass auth=: anyone who reaches the port sees every payload.
        click.echo(f"asyncjobq: warning: the dashboard on {host}:{port} has no authentication"
                   f"{'' if read_only else ' and can retry, cancel and pause'}: anyone who "
                   "can reach it may use it. Bind 127.0.0.1 behind an authenticating proxy, "
                   "or serve asyncjobq.dashboard.create_app(queue, auth=...) in your own ASGI "
                   "app.", err=True)
    click.echo(f"asyncjobq dashboard: requests naming another Host than {', '.join(hosts)} "
               "are refused (add names with --allowed-host)", err=True)
    click.echo(f"asyncjobq dashboard for schema {queue.schema}: http://"
               f"{'[' + host + ']' if ':' in host else host}:{port}/"
               f"{' (read-only)' if read_only else ''}", err=True)
    uvicorn.run(dash_app, host=host, port=port, log_level=log_level, lifespan="on")


def dashboard_hosts(host: str, extra: Sequence[str]) -> list[str]:
    """The Host names the CLI's dashboard answers: loopback ones, --host unless it is a
    wildcard address (0.0.0.0, ::), and each --allowed-host."""
    hosts = ["localhost", "127.0.0.1", "[::1]"]
    try:
        wildcard = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        wildcard = host in ("", "*")
    if not wildcard:
        hosts.append(f"[{host}]" if ":" in host else host)
    return list(dict.fromkeys([*hosts, *extra]))


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@main.command()
@click.option("--jobs", type=click.IntRange(min=1, max=1_000_000), default=3000,
              show_default=True)
@click.option("--workers", type=click.IntRange(min=1, max=16), default=2, show_default=True)
@click.option("--dsn", default=None, metavar="DSN", callback=_dsn_param,
              help="PostgreSQL DSN; else $ASYNCJOBQ_DSN; else the embedded server.")
@_guard
def demo(jobs: int, workers: int, dsn: str | None) -> None:
    """End to end: install, enqueue, run workers with a progress bar, print the outcomes."""
    from .demo import run_demo

    run_demo(dsn, jobs=jobs, workers=workers)




if __name__ == "__main__":  # pragma: no cover
    main()


