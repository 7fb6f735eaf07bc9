"""The package's layers (docs/how-it-works/architecture.md): no import cycle, no lower layer
importing a higher one, every module in a layer. Imports under `if TYPE_CHECKING:` are for the type
checker only and do not count."""

from __future__ import annotations

import ast
from pathlib import Path

import asyncjobq

PACKAGE = Path(asyncjobq.__file__).parent

# Bottom up. A module may import modules of its own layer and of the layers below it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("types", ("asyncjobq.errors", "asyncjobq._checks", "asyncjobq.job", "asyncjobq.task",
               "asyncjobq.hooks", "asyncjobq.schedule", "asyncjobq.retention")),
    ("database access", ("asyncjobq._db",)),
    ("worker machinery", ("asyncjobq._worker",)),
    # _waiting: Queue.wait's listener, a service of the public API beside the maintenance ones.
    ("maintenance services", ("asyncjobq._maintenance", "asyncjobq._waiting")),
    # Prometheus and OpenTelemetry: they watch jobs through the hooks and middleware and are
    # handed a Queue (never importing it), so that Queue and Worker can use them.
    ("integrations", ("asyncjobq.metrics", "asyncjobq.tracing")),
    # workflow: Queue.workflow()'s builder, which Queue.enqueue(after=) uses too.
    ("public API", ("asyncjobq.workflow", "asyncjobq.queue", "asyncjobq.worker", "asyncjobq")),
    ("tools", ("asyncjobq.cli", "asyncjobq.doctor", "asyncjobq.demo", "asyncjobq.runtime",
               "asyncjobq.logs",
               "asyncjobq.__main__", "asyncjobq.testing", "asyncjobq.pytest_plugin",
               "asyncjobq.dashboard")),
]


def module_name(path: Path) -> str:
    parts = ["asyncjobq", *path.relative_to(PACKAGE).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (module.startswith(prefix + ".") and prefix != "asyncjobq"):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), rank)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS (and to "
                             "docs/how-it-works/architecture.md)")
    return best[1]


def _type_checking_block(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING")


def runtime_imports(module: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking_block(child):
                continue
            if isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (child.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in child.names:
                    target = f"{base}.{alias.name}"
                    found.add(target if target in known else base)
            elif isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            visit(child)

    visit(tree)
    return {m for m in found if m in known and m != module}


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: runtime_imports(m, p, known) for m, p in mods.items()}


def test_every_module_is_in_a_layer_and_imports_only_downwards() -> None:
    wrong = []
    for module, imported in graph().items():
        for target in sorted(imported):
            if layer_of(target) > layer_of(module):
                wrong.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                             f"({LAYERS[layer_of(target)][0]})")
    assert not wrong, "lower layers import higher ones:\n" + "\n".join(wrong)


def test_no_import_cycles() -> None:
    g = graph()
    state: dict[str, int] = {}  # 1 visiting, 2 done
    cycles: list[list[str]] = []

    def dfs(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(g[node]):
            if state.get(nxt) == 1:
                cycles.append([*trail[trail.index(nxt):], nxt] if nxt in trail
                              else [node, nxt])
            elif nxt not in state:
                dfs(nxt, [*trail, nxt])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            dfs(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_public_api_is_what_init_exports() -> None:
    assert "__all__" in vars(asyncjobq)
    for name in asyncjobq.__all__:
        assert hasattr(asyncjobq, name), name
    # Machinery stays private: nothing under a `_` package is re-exported by name.
    for name in asyncjobq.__all__:
        obj = getattr(asyncjobq, name)
        assert not getattr(obj, "__module__", "asyncjobq").startswith(
            ("asyncjobq._db", "asyncjobq._worker", "asyncjobq._maintenance")), name


def test_the_layer_rule_catches_a_violation(tmp_path: Path) -> None:
    """The walk itself: machinery importing the public Queue is caught, TYPE_CHECKING is not."""
    fake = tmp_path / "fake.py"
    fake.write_text("from typing import TYPE_CHECKING\n"
                    "from .._db.ownconn import OwnConnection\n"
                    "if TYPE_CHECKING:\n    from ..worker import Worker\n"
                    "def f():\n    from ..queue import Queue\n")
    imports = runtime_imports("asyncjobq._worker.fake", fake, set(modules()))
    assert imports == {"asyncjobq._db.ownconn", "asyncjobq.queue"}
    assert layer_of("asyncjobq.queue") > layer_of("asyncjobq._worker.fake")
    assert layer_of("asyncjobq._db.sql.claim") == 1
