"""The reference pages (docs/reference/) against the code they describe: a metric, a hook
event, a setting, its default, an error or a span attribute that changes in the code and not in
its table (or the other way round) fails here, naming what differs."""

from __future__ import annotations

import ast
import inspect
import json
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import fed_collector

import asyncjobq
from asyncjobq import Queue, Worker, errors, hooks, testing
from asyncjobq.cli import main as cli

ROOT = Path(__file__).parent.parent
REFERENCE = ROOT / "docs" / "reference"
SRC = ROOT / "src" / "asyncjobq"


def page(name: str) -> str:
    return (REFERENCE / name).read_text()


def section(text: str, heading: str) -> str:
    """The text under the `## heading` (or `### heading`) line, up to the next heading of
    the same or a higher level."""
    match = re.search(rf"^(#+) {re.escape(heading)}\n", text, re.MULTILINE)
    assert match, f"no heading {heading!r}"
    level = len(match.group(1))
    rest = text[match.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.MULTILINE)
    return rest[:end.start()] if end else rest


def tables(text: str) -> list[list[list[str]]]:
    """The pipe tables of `text`: rows of stripped cells, header and rule rows left out."""
    found: list[list[list[str]]] = []
    rows: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
            continue
        if rows:
            found.append([r for r in rows[2:]])  # rows[0] is the header, rows[1] the rule
            rows = []
    return found


def table(text: str, heading: str, index: int = 0) -> list[list[str]]:
    found = tables(section(text, heading))
    assert len(found) > index, f"no table {index} under {heading!r}"
    return found[index]


def code(cell: str) -> str:
    """The name in a cell written `name`."""
    match = re.fullmatch(r"`([^`]+)`", cell)
    assert match, f"cell {cell!r} is not one `name`"
    return match.group(1)


def names(cell: str) -> list[str]:
    """The `names` of a cell listing them ("none" for none)."""
    return [] if cell == "none" else re.findall(r"`([^`]+)`", cell)


# --- metrics.md ---------------------------------------------------------------------------

def exported(queue: Queue) -> dict[str, tuple[str, list[str]]]:
    """Every family the real collector of `queue` exposes, by the name a scrape shows (with
    a counter's _total): (type, label names). Each event is fed once, so every family has a
    sample to read its labels from."""
    c = fed_collector(queue)
    c.add_worker("w", lambda: True)
    families: dict[str, tuple[str, list[str]]] = {}
    for family in c.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = list(dict.fromkeys(k for s in family.samples for k in s.labels if k != "le"))
        families[name] = (family.type, labels)
    return families


def test_every_metric_is_in_the_table_with_its_type_and_labels(queue: Queue) -> None:
    families = exported(queue)
    rows = table(page("metrics.md"), "Prometheus metrics")
    documented = {code(r[0]): (r[1], names(r[2])) for r in rows}
    assert sorted(documented) == sorted(families), (
        f"missing from metrics.md: {sorted(set(families) - set(documented))}; "
        f"in metrics.md but not exported: {sorted(set(documented) - set(families))}")
    for name, (kind, labels) in families.items():
        assert documented[name] == (kind, labels), (name, documented[name], (kind, labels))


# Names of the same shape that are not metrics: the demo's schema, the pytest plugin's fixtures.
NOT_METRICS = {"asyncjobq_demo", "asyncjobq_dsn", "asyncjobq_isolated"}


def test_every_metric_named_on_the_pages_exists(queue: Queue) -> None:
    """Metric names anywhere on metrics.md (prose, PromQL) and the other reference pages are
    series a scrape can show: a family, a counter's _total, a histogram's _bucket/_sum/_count."""
    families = exported(queue)
    series = set(families)
    for name, (kind, _) in families.items():
        if kind == "histogram":
            series |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    for name in ("metrics.md", "configuration.md", "hooks.md", "api.md"):
        used = set(re.findall(r"\basyncjobq_[a-z_]+", page(name)))
        unknown = used - series - NOT_METRICS
        assert not unknown, f"{name} names metrics that do not exist: {sorted(unknown)}"


def _span_attributes() -> set[str]:
    """The attribute keys tracing.py sets: keys of its `attributes` dicts, items assigned to
    them, and set_attribute's first argument."""
    tree = ast.parse((SRC / "tracing.py").read_text())
    keys: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            keys |= {k.value for k in node.keys if isinstance(k, ast.Constant)
                     and isinstance(k.value, str) and "." in k.value}
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.slice, ast.Constant):
            keys.add(node.slice.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "set_attribute" and isinstance(node.args[0], ast.Constant):
            keys.add(node.args[0].value)
    return keys


def test_every_span_attribute_is_in_the_table() -> None:
    spans = section(page("metrics.md"), "OpenTelemetry spans")
    (kinds, attributes) = tables(spans)[:2]
    documented = {code(r[0]) for r in attributes}
    keys = _span_attributes()
    assert keys, "no attribute found in tracing.py"
    assert documented == keys, (f"missing from metrics.md: {sorted(keys - documented)}; "
                                f"not set by tracing.py: {sorted(documented - keys)}")
    source = (SRC / "tracing.py").read_text()
    for row in kinds:
        verb = code(row[0]).removesuffix(" <queue>")
        assert re.search(rf'f"{verb} {{', source), f"no span named {verb} <queue> in tracing.py"


# --- hooks.md -----------------------------------------------------------------------------

def dispatched() -> dict[str, set[tuple[str, ...]]]:
    """Each event the code dispatches (hooks.spawn / hooks.emit anywhere in src) with the
    keyword arguments of each call site."""
    events: dict[str, set[tuple[str, ...]]] = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("spawn", "emit") and node.args \
                    and isinstance(node.args[0], ast.Constant) \
                    and str(node.args[0].value).startswith("on_"):
                kwargs = tuple(k.arg for k in node.keywords if k.arg is not None)
                events.setdefault(node.args[0].value, set()).add(kwargs)
    return events


def test_every_hook_event_is_in_the_table_with_its_arguments() -> None:
    calls = dispatched()
    assert set(calls) == set(hooks.EVENTS), (
        f"dispatched but not in hooks.EVENTS: {sorted(set(calls) - set(hooks.EVENTS))}; "
        f"in hooks.EVENTS but never dispatched: {sorted(set(hooks.EVENTS) - set(calls))}")
    rows = table(page("hooks.md"), "Events")
    documented = {code(r[0]): tuple(names(r[1])) for r in rows}
    assert sorted(documented) == sorted(hooks.EVENTS), (
        f"missing from hooks.md: {sorted(set(hooks.EVENTS) - set(documented))}; "
        f"in hooks.md but not an event: {sorted(set(documented) - set(hooks.EVENTS))}")
    for event, sites in calls.items():
        assert sites == {documented[event]}, (event, documented[event], sites)
    # The outcomes on_finished reports are the ones its row lists.
    finished_row = next(r for r in rows if code(r[0]) == "on_finished")
    assert set(hooks.FINISHED) <= set(re.findall(r"`([a-z]+)`", finished_row[2]))


def test_hook_methods_named_anywhere_are_events() -> None:
    for name in ("hooks.md", "api.md", "metrics.md"):
        # on_parent_failure: enqueue's argument (workflows), not a hook.
        used = set(re.findall(r"\bon_[a-z_]+", page(name))) - {"on_parent_failure"}
        assert used <= set(hooks.EVENTS), (name, sorted(used - set(hooks.EVENTS)))
    listing = re.findall(r"async def (on_[a-z_]+)\(self, ([^)]*)\)", page("api.md"))
    assert [m for m, _ in listing] == list(hooks.EVENTS)
    calls = dispatched()
    for method, params in listing:
        declared = tuple(p.split(":")[0].strip() for p in params.split(","))
        assert calls[method] == {declared}, (method, declared, calls[method])


def test_the_stated_hook_limits_are_the_codes() -> None:
    text = " ".join(page("hooks.md").split())
    assert f"`queue.hooks.timeout` seconds (default {hooks.Hooks().timeout:g})" in text
    assert f"At most {hooks.MAX_PENDING:,} hook calls" in text


# --- configuration.md ---------------------------------------------------------------------

def literal(value: object) -> str:
    """A default as the tables write it: Python syntax, strings in double quotes."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        items = [literal(v) for v in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(value, timedelta):
        return repr(value).removeprefix("datetime.")
    return repr(value)


SETTINGS = [("Queue", Queue.__init__), ("Worker", Worker.__init__), ("Per task", Queue.task)]


@pytest.mark.parametrize(("heading", "fn"), SETTINGS, ids=[h for h, _ in SETTINGS])
def test_every_setting_is_in_the_table_with_the_codes_default(heading: str, fn: Any) -> None:
    params = {n: p for n, p in inspect.signature(fn).parameters.items() if n != "self"}
    rows = table(page("configuration.md"), heading)
    documented = {code(r[0]): r[1] for r in rows}
    assert list(documented) == list(params), (
        f"{heading}: missing from configuration.md: {sorted(set(params) - set(documented))}; "
        f"not parameters: {sorted(set(documented) - set(params))}; or not in the code's order")
    for name, p in params.items():
        cell = documented[name]
        if p.default is inspect.Parameter.empty:
            assert cell == "required", (heading, name, cell)
        else:
            want = f"`{literal(p.default)}`"
            assert cell.startswith(want), f"{heading}.{name}: the code's default is {want}, " \
                                          f"configuration.md says {cell!r}"


def test_the_workers_cli_options_exist_with_the_same_defaults() -> None:
    rows = table(page("configuration.md"), "Worker")
    command = cli.commands["worker"]
    options = {opt: p for p in command.params for opt in p.opts}
    signature = inspect.signature(Worker.__init__).parameters
    for row in rows:
        flag = re.match(r"`(--[a-z-]+)`", row[2])
        if flag is None:
            assert row[2] in ("—", "`APP`"), row
            continue
        option = options.get(flag.group(1))
        assert option is not None, f"worker has no option {flag.group(1)}"
        name = code(row[0])
        if name in ("queues", "listen"):  # () means ("default",); --no-listen inverts listen
            continue
        assert option.default == signature[name].default, (name, option.default)


def test_every_environment_variable_is_in_the_table() -> None:
    used = set()
    for path in SRC.rglob("*.py"):
        used |= set(re.findall(r"\bASYNCJOBQ_[A-Z_]+\b", path.read_text()))
    rows = table(page("configuration.md"), "Environment variables")
    documented = {code(r[0]) for r in rows}
    assert documented == used, (sorted(used - documented), sorted(documented - used))
    assert testing.TEST_DSN_ENV in documented


# --- errors.md ----------------------------------------------------------------------------

def error_classes() -> dict[str, type[BaseException]]:
    return {c.__name__: c for c in vars(errors).values()
            if isinstance(c, type) and issubclass(c, BaseException)
            and c.__module__ == errors.__name__}


def test_every_error_is_in_the_table_with_its_bases() -> None:
    classes = error_classes()
    text = page("errors.md")
    rows = table(text, "Which error, when")
    documented = {code(r[0]): set(names(r[1])) for r in rows}
    assert sorted(documented) == sorted(classes), (
        f"missing from errors.md: {sorted(set(classes) - set(documented))}; "
        f"not classes of asyncjobq.errors: {sorted(set(documented) - set(classes))}")
    for name, cls in classes.items():
        assert documented[name] == {b.__name__ for b in cls.__bases__}, (name, documented[name])
        exported = name in asyncjobq.__all__
        where = f"asyncjobq.{name}" if exported else f"asyncjobq.errors.{name}"
        assert f".. autoexception:: {where}\n" in text, f"errors.md documents no {where}"


def test_every_public_name_has_its_entry_in_the_api_pages() -> None:
    text = page("api.md") + page("errors.md")
    directives = set(re.findall(r"\.\. auto(?:class|exception|function|data):: (\S+)", text))
    for name in asyncjobq.__all__:
        if name != "__version__":
            assert f"asyncjobq.{name}" in directives, f"api.md documents no asyncjobq.{name}"
    for name in testing.__all__:
        assert f"asyncjobq.testing.{name}" in directives, name
    assert "asyncjobq.dashboard.create_app" in directives
    # Each object once: a second description would be a duplicate (the build fails on it).
    everything = re.findall(r"\.\. auto(?:class|exception|function|data):: (\S+)", text)
    assert len(everything) == len(set(everything))
