"""The package's import graph: layers that only import downwards, and no cycle hidden in a
function.

Read from the source (``ast``), so a test needs no import order to be right. Every module-level
import is an edge, the ones under ``if TYPE_CHECKING:`` (a reader follows a type up as surely as
a call) and relative ones (``from ..pipeline import x``) included; the cycle check alone leaves
the type-only ones out, since they never run. An import inside a function is not a module-level
edge, but it must go down the layers too (its own test), and only the optional Django integration
is imported that way: the core reaches it through ``celery_fence.django_port``, never by name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import celery_fence

PACKAGE = Path(celery_fence.__file__).resolve().parent
#: Tools beside the product, free to import any of it (and the plugin imports lazily on purpose:
#: pytest loads it in every run of a user's suite).
TOOLS = ("celery_fence.testing", "celery_fence.chaos", "celery_fence.migrations")
#: Django is optional: the public names (above it) import its integration only inside the
#: function that needs it; the core reaches it only through the port ``celery_fence.django_port``,
#: where the integration registers itself.
DJANGO = "celery_fence.contrib.django"
#: The layers, bottom first: a module imports (at module level) only from its own layer and the
#: layers below it. Two packages in one layer import neither of each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    # what everything uses; the port through which the core reaches the Django integration
    ("errors", "actions", "schema", "signals", "app_state", "migrate", "django_port"),
    ("process", "metrics"),  # the per-process registry and threads; the metrics observer
    ("leases",),  # the Redis side
    ("settings",),  # each setting's name, default and type; how one is read from app.conf
    ("config",),  # the settings, each validated by the layer it configures
    ("store",),  # the fence tables
    ("body", "announce"),  # what a task body sees; transitions, events and log records
    ("pipeline",),  # one attempt: execution, settle, retry, and the backends it is built from
    ("ops",),  # the operator's side: recovery, retention, requeue, outbox delivery, the CLI
    ("adapters",),  # Celery's side: FencedTask, FencedRequest, install(app)
    ("durable",),  # enqueue(): a pending row in the caller's transaction
    ("beat",),  # the scheduler: each tick enqueued under its tick key
    ("compat",),  # the celery-once and celery-singleton shims, over unique jobs
    ("contrib",),  # the optional Django integration
    ("__init__",),  # the public names: ``from celery_fence import FencedTask``
    ("testing",),  # the pytest plugin, the doubles, the worker harness
    ("chaos",),  # the chaos harness and its control arms
    ("migrations",),  # Alembic's scripts
)
CORE = tuple(f"celery_fence.{name}" for layer in LAYERS[: LAYERS.index(("ops",))] for name in layer)
ABOVE_CORE = ("celery_fence.adapters", "celery_fence.ops", DJANGO, *TOOLS)


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module`` (``celery_fence`` itself: its ``__init__``)."""
    parts = module.split(".")
    first = parts[1] if len(parts) > 1 else "__init__"
    for index, layer in enumerate(LAYERS):
        if first in layer:
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def _modules() -> tuple[dict[str, ast.Module], frozenset[str]]:
    out, packages = {}, set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text(encoding="utf-8"))
        if path.name == "__init__.py":
            packages.add(name)
    return out, frozenset(packages)


MODULES, PACKAGES = _modules()


def _absolute(node: ast.ImportFrom, importer: str) -> str:
    """The module ``from <module> import ...`` names, a relative one resolved against
    ``importer``'s package."""
    if not node.level:
        return node.module or ""
    package = importer.split(".") if importer in PACKAGES else importer.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _targets(node: ast.Import | ast.ImportFrom, importer: str) -> Iterator[str]:
    """The celery_fence modules an import statement of ``importer`` loads (a name that is a
    module counts; a relative import counts as the absolute one it is)."""
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names if a.name.split(".")[0] == "celery_fence")
        return
    module = _absolute(node, importer)
    if module.split(".")[0] == "celery_fence":
        loaded = (f"{module}.{a.name}" for a in node.names)
        yield from dict.fromkeys(full if full in MODULES else module for full in loaded)


def _module_level(tree: ast.Module, *, type_only: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The module-level imports that run (``type_only=False``), or those under ``if
    TYPE_CHECKING:`` (``True``)."""
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        typing_only = isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test)
        if typing_only == type_only:
            yield from (n for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom)))


def _in_functions(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from (n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))


def in_functions(modules: dict[str, ast.Module] | None = None) -> dict[str, set[str]]:
    """Each module's imports inside its functions (methods and nested functions included)."""
    return {
        name: {t for node in _in_functions(tree) for t in _targets(node, name) if t != name}
        for name, tree in (MODULES if modules is None else modules).items()
    }


def _under(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def graph(
    modules: dict[str, ast.Module] | None = None, *, type_only_too: bool = True
) -> dict[str, set[str]]:
    """Each module's module-level edges: the imports that run, and (``type_only_too``) those
    under ``if TYPE_CHECKING:``."""
    kinds = (False, True) if type_only_too else (False,)
    return {
        name: {
            t
            for kind in kinds
            for node in _module_level(tree, type_only=kind)
            for t in _targets(node, name)
            if t != name
        }
        for name, tree in (MODULES if modules is None else modules).items()
    }


def upward(edges: dict[str, set[str]]) -> list[str]:
    """The edges of ``edges`` that go up the layers."""
    return sorted(
        f"{name} -> {target}"
        for name, targets in edges.items()
        for target in targets
        if layer_of(target) > layer_of(name)
    )


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``edges`` (Tarjan's strongly connected components of two or more)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_module_level_imports_have_no_cycle() -> None:
    # (the type-only ones never run: a module may name, for its types, one that imports it)
    assert cycles(graph(type_only_too=False)) == []


def test_the_cycle_finder_finds_one() -> None:
    # (a check that cannot fire is no check)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_in_a_function_goes_up_the_layers() -> None:
    # (the tools included: an import deferred into a function is an edge all the same)
    assert upward(in_functions()) == []


def test_no_import_in_a_function_stands_in_for_a_module_level_one() -> None:
    # Given every import inside a function of the product (the tools beside it left out) ...
    deferred = [
        f"{name}: {target}"
        for name, targets in in_functions().items()
        if not _under(name, TOOLS)
        for target in targets
        # ... the only ones are the public names reaching down for the optional Django
        # integration (enqueue(None, ...), the port's loader), and that integration's own
        # AppConfig.ready (Django's place to register system checks)
        if not (name == "celery_fence" and _under(target, (DJANGO,))) and name != f"{DJANGO}.apps"
    ]
    assert deferred == []


def test_the_layer_check_sees_an_upward_import_inside_a_function() -> None:
    # (a check that cannot fire is no check) Given the core reaching the Django integration
    # by name inside a method, a nested function and a relative import, as it once did ...
    sources = {
        "celery_fence.body.fenced": (
            "class Fence:\n"
            "    def atomic(self, using=None):\n"
            "        from celery_fence.contrib.django.atomic import atomic\n"
            "        return atomic(self, using)\n"
        ),
        "celery_fence.settings": (
            "def outer():\n"
            "    def inner():\n"
            "        from .contrib.django import database\n"
            "    return inner\n"
        ),
        "celery_fence.adapters.down": "def f():\n    from celery_fence.store import sql\n",
    }
    modules = {name: ast.parse(source) for name, source in sources.items()}
    # Then each upward one is found, the downward one is not, and none is a module-level edge
    assert upward(in_functions(modules)) == [
        "celery_fence.body.fenced -> celery_fence.contrib.django.atomic",
        "celery_fence.settings -> celery_fence.contrib.django.database",
    ]
    assert in_functions(modules)["celery_fence.adapters.down"] == {"celery_fence.store.sql"}
    assert upward(graph(modules)) == []


def test_the_core_reaches_django_only_through_the_port() -> None:
    # (the integration registers itself in its package __init__, which every import of it and
    # Django's app loading run; the public names register the loader that imports it)
    assert "celery_fence.django_port" in graph()[DJANGO]
    assert "celery_fence.django_port" in graph()["celery_fence"]
    assert DJANGO in in_functions()["celery_fence"]


def test_every_module_level_import_goes_down_the_layers_or_stays_in_its_own() -> None:
    # (type-only and relative imports included)
    assert upward(graph()) == []


def test_the_layer_check_sees_type_only_relative_and_plain_upward_imports() -> None:
    # (a check that cannot fire is no check) Given modules of the store layer that import the
    # pipeline above it: under TYPE_CHECKING, relatively, and plainly, in a package and in a module
    sources = {
        "celery_fence.store.typed": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from celery_fence.pipeline.execution import Execution\n"
        ),
        "celery_fence.store.relative": "from ..pipeline import settle\n",
        "celery_fence.store.relative_name": "from ..pipeline.outcomes import Outcome\n",
        "celery_fence.store.plain": "import celery_fence.pipeline.retry\n",
        "celery_fence.store.down": "from . import sql\nfrom ..schema import utcnow\n",
    }
    modules = {name: ast.parse(source) for name, source in sources.items()}
    # Then each upward one is found, and the downward ones are not
    assert upward(graph(modules)) == [
        "celery_fence.store.plain -> celery_fence.pipeline.retry",
        "celery_fence.store.relative -> celery_fence.pipeline.settle",
        "celery_fence.store.relative_name -> celery_fence.pipeline.outcomes",
        "celery_fence.store.typed -> celery_fence.pipeline.execution",
    ]
    assert graph(modules)["celery_fence.store.down"] == {
        "celery_fence.store.sql",
        "celery_fence.schema",
    }
    # And the cycle check leaves the type-only edge out, the layer check does not
    assert graph(modules, type_only_too=False)["celery_fence.store.typed"] == set()


def test_two_packages_of_one_layer_import_neither_of_each_other() -> None:
    def package(module: str) -> str:
        return module.split(".")[1] if "." in module else "__init__"

    across = sorted(
        f"{name} -> {target}"
        for name, targets in graph().items()
        for target in targets
        if layer_of(target) == layer_of(name)
        and len(LAYERS[layer_of(name)]) > 1
        and package(target) != package(name)
        and layer_of(name) != 0  # the base modules are one layer of small leaves
    )
    assert across == []


def test_the_core_imports_neither_the_celery_adapters_nor_the_operator_side() -> None:
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in graph().items()
        if _under(name, CORE)
        for target in targets
        if _under(target, ABOVE_CORE)
    )
    assert upward == []


def test_the_operator_side_does_not_import_the_celery_adapters() -> None:
    # (the adapters install the operator side's beat tasks and trigger outbox delivery: the edge
    # goes one way)
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in graph().items()
        if _under(name, ("celery_fence.ops",))
        for target in targets
        if _under(target, ("celery_fence.adapters",))
    )
    assert upward == []


def test_enqueue_and_djangos_enqueue_import_one_way() -> None:
    # (Django's enqueue builds on the core's, which never reaches back for it, not even in a
    # function: the deprecated enqueue(None, ...) is the public names' to route)
    core = {name: tree for name, tree in MODULES.items() if _under(name, ("celery_fence.durable",))}
    assert {"celery_fence.durable", "celery_fence.durable.sends"} <= set(core)
    reached = {
        target
        for name, tree in core.items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for target in _targets(node, name)
    }
    assert not any(_under(target, (DJANGO,)) for target in reached)
    assert "celery_fence.durable" in graph()[f"{DJANGO}.durable"]
