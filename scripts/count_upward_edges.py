"""Count the package's upward import edges, independently of tests/unit/test_layers.py.

It takes only the layer names from test_layers.py (its ``LAYERS`` literal, read with ``ast``), and
walks every import statement of every module itself: module level, under ``if TYPE_CHECKING:``,
inside functions, absolute and relative (resolved against the importing module's package). An edge
is upward when the target's layer comes after the importer's.

    python scripts/count_upward_edges.py          # the count by kind, then every edge
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "celery_fence"


def layers() -> list[tuple[str, ...]]:
    tree = ast.parse((ROOT / "tests" / "unit" / "test_layers.py").read_text(encoding="utf-8"))
    for stmt in tree.body:
        target = stmt.target if isinstance(stmt, ast.AnnAssign) else None
        if isinstance(stmt, ast.Assign):
            target = stmt.targets[0]
        if isinstance(target, ast.Name) and target.id == "LAYERS" and stmt.value is not None:
            return [tuple(layer) for layer in ast.literal_eval(stmt.value)]
    raise SystemExit("no LAYERS in tests/unit/test_layers.py")


LAYERS = layers()


def rank(module: str) -> int:
    parts = module.split(".")
    first = parts[1] if len(parts) > 1 else "__init__"
    for i, layer in enumerate(LAYERS):
        if first in layer:
            return i
    raise SystemExit(f"{module}: in no layer")


def modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


MODULES = modules()


def kind_of(parents: list[ast.AST]) -> str:
    for p in reversed(parents):
        if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return "function"
    for p in parents:
        if isinstance(p, ast.If) and "TYPE_CHECKING" in ast.dump(p.test):
            return "type-only"
    return "module"


def targets(module: str, is_pkg: bool, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "celery_fence"]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        package = module.split(".") if is_pkg else module.split(".")[:-1]
        base = package[: len(package) - (node.level - 1)]
        full = ".".join(base + ([node.module] if node.module else []))
    else:
        full = node.module or ""
    if full.split(".")[0] != "celery_fence":
        return []
    out = []
    for alias in node.names:
        sub = f"{full}.{alias.name}"
        out.append(sub if sub in MODULES else full)
    return out


def edges() -> list[tuple[str, str, str, bool]]:
    found: list[tuple[str, str, str, bool]] = []
    for module, (path, is_pkg) in sorted(MODULES.items()):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        stack: list[tuple[ast.AST, list[ast.AST]]] = [(tree, [])]
        while stack:
            node, parents = stack.pop()
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                relative = isinstance(node, ast.ImportFrom) and node.level > 0
                for t in targets(module, is_pkg, node):
                    if t != module:
                        found.append((module, t, kind_of(parents), relative))
            stack.extend((child, [*parents, node]) for child in ast.iter_child_nodes(node))
    return found


def main() -> int:
    upward = sorted({e for e in edges() if rank(e[1]) > rank(e[0])})
    counts = Counter(kind for _, _, kind, _ in upward)
    relative = sum(1 for e in upward if e[3])
    print(
        f"upward edges: {len(upward)} (module level {counts['module']}, type-only "
        f"{counts['type-only']}, inside functions {counts['function']}; relative {relative})"
    )
    for importer, target, kind, rel in upward:
        print(f"  {importer} -> {target}  [{kind}{', relative' if rel else ''}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
